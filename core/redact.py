"""What may be a secret, kept out of every file, log and tracker a run writes: flag values of secret-named flags
(--api-key VALUE), and the user and query parts of URLs (http://user:token@host/?key=...)."""

from __future__ import annotations

import re
import urllib.parse

# Flags: secret words as a whole word (--api-key, --hf-token; not --max-num-batched-tokens, --tokenizer: kept, to
# reproduce the run). core.server matches environment variable names with the same words, anywhere in the name.
SECRET_WORDS = "key|token|secret|password|passwd|credentials?"
SECRET_FLAG = re.compile(rf"(?<![a-z])(?:{SECRET_WORDS})(?![a-z])", re.IGNORECASE)
REDACTED = "<redacted>"
_URL = re.compile(r"https?://[^\s'\"<>]+")
_QUERY = re.compile(r"\?[^\s'\"()<>?]*=[^\s'\"()<>]*")


def redact_args(argv: list[str] | tuple[str, ...]) -> list[str]:
    """`argv` with the value of every secret-named flag replaced by REDACTED, in both `--api-key VALUE` and
    `--api-key=VALUE` forms; a following `--flag` is not a value (vLLM's --hf-token may stand alone)."""
    shown, hide_next = [], False
    for arg in argv:
        if hide_next and not arg.startswith("--"):
            shown.append(REDACTED)
            hide_next = False
            continue
        flag, has_value, _ = arg.partition("=")
        secret = arg.startswith("-") and SECRET_FLAG.search(flag.lstrip("-")) is not None
        hide_next = secret and not has_value
        shown.append(f"{flag}={REDACTED}" if secret and has_value else arg)
    return shown


def redact_url(url: str) -> str:
    """`url` without what may be a secret: a user and password (http://user:token@host) and the query string
    (?key=...) become REDACTED; the scheme, host, port and path stay, so that a message still names the server."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # 'http://[::1' (an unclosed IPv6 bracket)
        parts = None
    if parts is None or not parts.netloc:  # not a URL urlsplit reads ('user:token@host:8000' has no '//'): crudely
        head, at, tail = url.rpartition("@")
        if at:
            scheme = re.match(r"[a-z][a-z0-9+.-]*://", head, re.IGNORECASE)
            url = (scheme.group(0) if scheme else "") + f"{REDACTED}@{tail}"
        return _QUERY.sub(f"?{REDACTED}", url)
    try:
        host = (parts.hostname or "") if parts.port is None else f"{parts.hostname}:{parts.port}"
    except ValueError:  # a port that is not a number: keep the netloc without its user part
        host = parts.netloc.rpartition("@")[2]
    netloc = f"{REDACTED}@{host}" if "@" in parts.netloc else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, REDACTED if parts.query else "", ""))


def redact_urls(text: str) -> str:
    """`text` with every http(s) URL in it redacted (redact_url), and any other query string (an HTTP library's
    message quotes the path alone: 'with url: /v1?key=...'): for error files, logs and tracker configs."""
    return _QUERY.sub(f"?{REDACTED}", _URL.sub(lambda match: redact_url(match.group(0)), text))
