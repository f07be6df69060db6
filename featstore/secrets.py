"""Keeping credentials out of what mmcache prints and writes.

Secret values mmcache is handed are registered once and ``redact()`` hides them in any text;
``redact_url()`` drops signatures, tokens and passwords from URLs; ``RedactedOptions`` hides its
values in its repr (docs/design/store.md, "Secrets").
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

MASK = "***"

# Option keys whose values are secrets (fsspec/s3fs/gcsfs/adlfs names, matched case-insensitively
# as substrings), and environment variables that hold credentials.
_SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|signature|sas|session|auth|private|(^|_)key$|^key$|access_key", re.I)
_SECRET_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON",
)
# Query parameters that make a URL a credential (S3/GCS presigned URLs, Azure SAS, generic tokens).
_SIGNED_PARAM = re.compile(
    r"(?i)(x-amz-|x-goog-|signature|awsaccesskeyid|googleaccessid|(^|&|\?)(sig|se|sp|sv|st|skoid|sktid|token|access_token|key)=)"
)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")

_lock = threading.Lock()
_secrets: set[str] = set()


def register(value: Any) -> None:
    """Remember the secret values in ``value`` (a storage-options mapping or a string)."""
    found: set[str] = set()
    _collect(value, found, secret=isinstance(value, str))
    with _lock:
        _secrets.update(s for s in found if len(s) >= 4)


def _collect(value: Any, found: set[str], secret: bool) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _collect(item, found, secret or bool(_SECRET_KEY.search(str(key))))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found, secret)
    elif isinstance(value, str) and secret:
        found.add(value)


def _known() -> list[str]:
    for name in _SECRET_ENV:
        if os.environ.get(name):
            register(os.environ[name])
    with _lock:
        return sorted(_secrets, key=len, reverse=True)  # longest first: no partial leftovers


def redact_url(url: str) -> str:
    """``url`` without user:password and without the query string when that carries a signature
    or token; other URLs are returned as they are."""
    url = _USERINFO.sub(r"\1" + MASK + "@", url)
    base, sep, query = url.partition("?")
    if sep and _SIGNED_PARAM.search("?" + query):
        return f"{base}?{MASK}"
    return url


def redact(text: Any) -> str:
    """``text`` with every known secret value and every signed URL query masked."""
    out = _URL.sub(lambda m: redact_url(m.group(0)), str(text))
    for secret in _known():
        if secret in out:
            out = out.replace(secret, MASK)
    return out


class RedactedOptions(dict):
    """Storage options whose repr/str show the keys only (values may be credentials)."""

    def __repr__(self) -> str:
        return "RedactedOptions(" + ", ".join(f"{k}={MASK}" for k in self) + ")"

    __str__ = __repr__
