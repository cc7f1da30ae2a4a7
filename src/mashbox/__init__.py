"""mashbox: one local model served to OpenAI and Anthropic clients."""

__version__ = "0.1.0"
