"""Who may talk to the server: API keys and tenants, Host (DNS rebinding) and Origin checks.

Rules (seed 000 `info.description`, seed 001's security schemes):
- On a loopback address with no key configured, no key is checked and a key sent is ignored.
- With keys (`--api-key-file`, `MASHBOX_API_KEY`), and always on a non-loopback address,
  every route but the probes (`/`, `/health`, `/health/live`, HEAD anywhere) and
  `/v1/capabilities` needs one: `Authorization: Bearer K`, `x-api-key: K` or
  `x-privy-token: K`.
- A Host header naming the server by a name it does not answer to is refused (403), and so is
  a request whose Origin is another origin than the one it addresses (a web page elsewhere).
  `/health` and `/` stay open to local probes.
- A server reached through a tunnel or proxy needs a key: `--allowed-host` without one is
  refused at start (launch.make_guard), and a keyless server refuses any request that a
  proxy forwarded (`Forwarded`, `X-Forwarded-For`, `Cf-Connecting-Ip`, `X-Real-Ip`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from .errors import ApiError

OPEN_PATHS = frozenset({"/", "/health", "/health/live"})  # probes: no key, no Host check
# Seed 001 marks this `security: []`: it describes the server, never runs the model.
# (/v1/openapi.json is /openapi.json under 001's name, and needs a key like it.)
KEYLESS_PATHS = frozenset({"/v1/capabilities"})
# What a reverse proxy or tunnel adds to a request it forwards.
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "cf-connecting-ip", "x-real-ip")
_BEARER = re.compile(r"bearer\s+", re.IGNORECASE)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class KeyFileError(ValueError):
    """The key file cannot be read or has a malformed line."""


def tenant_of_unnamed(key: str) -> str:
    """A key without a tenant name is its own tenant (named by a hash: keys are never logged)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def read_key_file(path: Path) -> dict[str, str]:
    """Parse `KEY [TENANT]` lines (blank lines and # comments skipped) into key -> tenant."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise KeyFileError(f"{path}:{number}: expected 'KEY [TENANT]'")
        key = fields[0]
        keys[key] = fields[1] if len(fields) == 2 else tenant_of_unnamed(key)
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def split_host(value: str) -> str:
    """The host name of a Host header or an origin's netloc, lower case, IPv6 unbracketed."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@attrs.define
class Guard:
    """The server's access rules, checked before any route runs."""

    bound_host: str
    keys: dict[str, str] = attrs.Factory(dict)  # key -> tenant
    allowed_hosts: frozenset[str] = frozenset()

    @property
    def keys_required(self) -> bool:
        """Keys were given, or the server is reachable from elsewhere: bound off loopback,
        or named by another host (a tunnel or proxy's)."""
        return bool(self.keys) or not is_loopback(self.bound_host) or bool(self.allowed_hosts)

    def authenticated(self, headers) -> bool:
        """Whether the request may see what only key holders see (always, without keys)."""
        return not self.keys_required or self.tenant(headers) is not None

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether the Host header names this server (ports vary through SSH tunnels)."""
        if not host_header:
            return False
        host = split_host(host_header)
        if host in LOOPBACK_NAMES or host in self.allowed_hosts:
            return True
        bound = self.bound_host.strip("[]").lower()
        if host == bound:
            return True
        # Bound to every interface: any address literal names us (DNS rebinding needs a name).
        return bound in ("0.0.0.0", "::") and _is_ip(host)

    def tenant(self, headers) -> str | None:
        """The tenant of the key the request carries, or None; every key is compared, each in
        constant time, so timing tells nothing about which or how much matched."""
        sent = [
            _BEARER.sub("", value, count=1).strip()  # the scheme in any case (RFC 9110)
            for value in (
                headers.get("authorization"),
                headers.get("x-api-key"),
                headers.get("x-privy-token"),
            )
            if value
        ]
        found = None
        for key, tenant in self.keys.items():
            for candidate in sent:
                if hmac.compare_digest(candidate.encode(), key.encode()) and found is None:
                    found = tenant
        return found

    def check(self, path: str, headers) -> str:
        """Raise a 403/401 ApiError, or return the request's tenant ("" when keys are off)."""
        if path in OPEN_PATHS:
            return ""
        host = headers.get("host")
        if not self.host_allowed(host):
            raise ApiError(403, "this server does not answer to that host name", type="forbidden")
        origin = headers.get("origin")
        if origin and not _same_origin(origin, host):
            raise ApiError(403, "requests from another origin are refused", type="forbidden")
        if not self.keys and any(headers.get(h) for h in FORWARDING_HEADERS):
            raise ApiError(
                403,
                "this request came through a proxy or tunnel, and this server has no API key: "
                "start it with --api-key-file FILE or MASHBOX_API_KEY (or use ssh -L)",
                type="forbidden",
            )
        # Every route but the probes and the route list: a route added outside /v1 (vLLM's
        # /tokenize, llama-server's /infill) must not be left open by omission, as they were.
        if path in KEYLESS_PATHS or not self.keys_required:
            return ""
        tenant = self.tenant(headers)
        if tenant is None:
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer, x-api-key or x-privy-token)",
                type="authentication_error",
                code="invalid_api_key",
            )
        return tenant


def _same_origin(origin: str, host: str | None) -> bool:
    """The page's origin addresses the host it sends the request to (scheme http/https)."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not host:
        return False
    return parts.netloc.lower() == host.strip().lower()
