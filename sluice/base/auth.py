"""API keys, as the server and the router check them."""
from __future__ import annotations

import hmac

OPEN_PATHS = frozenset({"/health", "/ready", "/health_generate", "/metrics", "/prometheus/metrics", "/version",
                        "/openapi.json"})
MISSING_KEY = "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
CHALLENGE = (b"www-authenticate", b"Bearer")


def authorized(path: str, headers: list[tuple[bytes, bytes]], keys: list[bytes], protect_all: bool) -> bool:
    """Whether a request may go on: no keys configured, an open path, or 'Authorization: Bearer KEY' (OpenAI's
    clients) or 'x-api-key: KEY' (Anthropic's)."""
    if not keys or (path in OPEN_PATHS and not protect_all):
        return True
    given = dict(headers)
    header = given.get(b"authorization", b"")
    token = header[7:] if header[:7].lower() == b"bearer " else given.get(b"x-api-key", b"")
    # compare with every key, always, so the time taken says nothing about which key is close
    return sum(hmac.compare_digest(token, key) for key in keys) > 0
