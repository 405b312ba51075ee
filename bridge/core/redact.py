"""Remove secrets from anything that may reach a log line, a span, Flower or attempt metadata."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_SECRET_IN_TEXT = re.compile(
    r"(?i)(api[_-]?key|token|password|secret|authorization)([\"']?\s*[:=]\s*[\"']?)([^\s\"',&]+)"
)


def redact_url(url: str) -> str:
    """Replace the password part of a URL (``redis://:pw@host``) with ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact_text(text: str) -> str:
    """Mask ``key=value`` style secrets and URL passwords inside free text (error messages)."""
    text = re.sub(r"(\w+://[^:/\s@]*:)([^@\s]+)(@)", r"\1***\3", text)
    return _SECRET_IN_TEXT.sub(r"\1\2***", text)
