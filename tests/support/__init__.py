"""Helpers the tests share: real servers, raw sockets, tiny models built on the spot."""
