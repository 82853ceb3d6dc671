"""Whether the Hugging Face hub can be asked: the environment's offline switches, and a 3 s reachability probe so
that an offline machine fails at once instead of retrying for ~25 s. Prompt sources (data/sources/readers.py) and targets
(modeling/target.py) ask here."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_variable() -> str | None:
    """The first of OFFLINE_VARIABLES the environment switches on (1, on, yes, true), else None."""
    return next((name for name in OFFLINE_VARIABLES
                 if os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}), None)


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


@functools.lru_cache(maxsize=None)
def hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    url = urlparse(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme != "http" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_unavailable() -> str | None:
    """Why nothing can be fetched from the hub here ('the hub is offline (HF_HUB_OFFLINE=1)', '... unreachable'), or
    None when it may be."""
    variable = offline_variable()
    if variable:
        return f"the hub is offline ({variable}={os.environ[variable]})"
    if not hub_reachable(hub_endpoint()):
        return f"the hub ({hub_endpoint()}) is unreachable from here"
    return None
