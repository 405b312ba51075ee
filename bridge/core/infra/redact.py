"""Remove secrets from anything that may reach a log line, a span, Flower or attempt metadata."""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit, urlunsplit

_SECRET_IN_TEXT = re.compile(r"(?i)(api[_-]?key|token|password|secret)([\"']?\s*[:=]\s*[\"']?)([^\s\"',&]+)")
# An Authorization header's value (its scheme, e.g. Bearer or Basic, stays readable) and a bearer token anywhere.
_AUTHORIZATION = re.compile(
    r"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?)"
    r"(?>(?:(bearer|basic|digest|token|apikey|negotiate|ntlm|aws4-hmac-sha256)\s+)?)(?!\*\*\*)[^\s\"',;]+"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)(?!\*\*\*)[^\s\"',;]+")
# Query (or fragment) parameters whose value is a secret: api_key, key, token, access_token, sig, X-Amz-Signature...
_SECRET_NAME = r"[\w.-]*?(?:key|token|secret|passw(?:or)?d|pwd|sig|signature|credentials?|auth)"
_SECRET_PARAM = re.compile(rf"(?i){_SECRET_NAME}")
_SECRET_PARAM_IN_TEXT = re.compile(rf"(?i)([?&;#]{_SECRET_NAME}=)(?!\*\*\*)[^&#;\s\"'<>]+")


def redact_url(url: str) -> str:
    """Replace the password (``redis://:pw@host``) and secret query values (``?api_key=``, ``&sig=``) with ``***``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # an unreadable host or port: the text rules still find a password or a token
        return redact_text(url)
    netloc = parts.netloc
    if parts.password:
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        netloc = f"{parts.username or ''}:***@{host}" + (f":{port}" if port else "")
    query, fragment = _redact_params(parts.query), _redact_params(parts.fragment)
    if (netloc, query, fragment) == (parts.netloc, parts.query, parts.fragment):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def redact_text(text: str) -> str:
    """Mask URL passwords, secret query values, bearer tokens, Authorization values and ``key=value`` secrets."""
    text = re.sub(r"(\w+://[^:/\s@]*:)([^@\s]+)(@)", r"\1***\3", text)
    text = _SECRET_PARAM_IN_TEXT.sub(r"\1***", text)
    text = _AUTHORIZATION.sub(_masked_authorization, text)
    text = _BEARER.sub(r"\1***", text)
    return _SECRET_IN_TEXT.sub(r"\1\2***", text)


def redact_error(exc: BaseException) -> str:
    """An exception as it may leave the process (a log line, a task's result, a report's error): its type and its
    message masked by ``redact_text``."""
    return f"{type(exc).__name__}: {redact_text(str(exc))}"


def _masked_authorization(match: re.Match[str]) -> str:
    scheme = match.group(2)
    return f"{match.group(1)}{scheme} ***" if scheme else f"{match.group(1)}***"


def _redact_params(query: str) -> str:
    """``a=1&token=x`` -> ``a=1&token=***``; the order, separators and other values are kept byte for byte."""
    if "=" not in query:
        return query
    pieces = re.split(r"([&;])", query)
    for i in range(0, len(pieces), 2):
        name, sep, value = pieces[i].partition("=")
        if sep and value and _SECRET_PARAM.fullmatch(unquote_plus(name).strip()):
            pieces[i] = f"{name}=***"
    return "".join(pieces)
