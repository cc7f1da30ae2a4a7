"""The MASHBOX Chat page (`mashbox run --ui`): one self-contained HTML file, served on /.

The page's only script and style are inline, so its Content-Security-Policy allows exactly
those two (by sha256) and requests to its own origin: nothing is fetched from elsewhere, and
markup that ever slipped into the page from model output could not run a script.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

import attrs

PAGE = "chat.html"


@attrs.frozen
class Page:
    body: bytes
    headers: dict[str, str]


def _hashes(html: str, tag: str) -> str:
    """'sha256-...' sources for every inline <tag> element's text."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    if not bodies:
        raise ValueError(f"{PAGE} has no inline <{tag}>")
    return " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'"
        for b in bodies
    )


def load() -> Page:
    """Read the page and build its headers."""
    html = resources.files(__name__).joinpath(PAGE).read_text(encoding="utf-8")
    policy = "; ".join(
        [
            "default-src 'none'",
            f"script-src {_hashes(html, 'script')}",
            f"style-src {_hashes(html, 'style')}",
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    headers = {
        "Content-Type": "text/html; charset=utf-8",
        "Content-Security-Policy": policy,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    return Page(html.encode("utf-8"), headers)
