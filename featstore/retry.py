"""Retrying remote storage operations: which faults are transient, backoff, clear errors.

A transient fault is tried again with exponential backoff and jitter, bounded in attempts and
time; one that persists, a missing object or a denied request fails with an error naming the
object, never a credential. The one retry layer: ``remote_filesystem`` turns fsspec's and
botocore's own retries off (docs/design/store.md, "Retries").
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from . import secrets
from .errors import FeatstoreError, StorageError

log = logging.getLogger("mmcache.featstore.storage")
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8           # tries of one operation, the first included
    base_delay: float = 0.1     # seconds before the first retry; doubles each time, with jitter
    max_delay: float = 5.0
    deadline: float = 120.0     # seconds after which an operation is not tried again
    # Per attempt, enforced by the HTTP client: a stalled connection ends an attempt after this
    # long without a byte, so an operation ends within deadline + one attempt's timeout.
    connect_timeout: float = 10.0
    read_timeout: float = 30.0


_S3_PROTOCOLS = frozenset({"s3", "s3a"})


def lower_layer_options(protocol: str | None, storage_options: dict[str, Any] | None, policy: RetryPolicy | None = None) -> dict[str, Any]:
    """``storage_options`` for ``protocol`` with the client's own retries set to one attempt and
    its timeouts to the policy's, unless the user set them (an explicit choice is kept)."""
    options = dict(storage_options or {})
    if protocol in _S3_PROTOCOLS:
        policy = policy or RetryPolicy()
        config = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                  "connect_timeout": policy.connect_timeout, "read_timeout": policy.read_timeout}
        options["config_kwargs"] = {**config, **(options.get("config_kwargs") or {})}
    return options


def remote_filesystem(url: str, storage_options: dict[str, Any] | None = None, policy: RetryPolicy | None = None) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs`` with one retry layer (this module's): see the module doc."""
    import fsspec

    protocol = fsspec.core.split_protocol(str(url))[0]
    fs, path = fsspec.core.url_to_fs(str(url), **lower_layer_options(protocol, storage_options, policy))
    if protocol in _S3_PROTOCOLS:
        # s3fs's retry count is a class attribute, not an option: one attempt per call of ours.
        fs.retries = 1
    return fs, path


def protocol_of(fs: Any) -> str:
    """A filesystem's protocol name (fsspec gives a tuple of aliases for some: the first)."""
    return fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol


# Exception classes of the HTTP stacks under fsspec (aiohttp, botocore, urllib3, s3fs), named
# rather than imported so featstore needs none of them.
_TRANSIENT_NAMES = frozenset({
    "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
    "ServerTimeoutError", "ClientConnectorError", "HTTPClientError", "EndpointConnectionError",
    "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError", "IncompleteReadError",
    "ResponseStreamingError", "ResponseParserError", "IncompleteRead", "FSTimeoutError",
    "ProtocolError", "ProxyConnectionError", "ChunkedEncodingError",
})
# Libraries whose own errors (no credentials, bad parameters, ...) mean the request failed.
_CLIENT_MODULES = frozenset({"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs", "adlfs", "urllib3", "requests"})
_THROTTLING = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                         "TooManyRequests", "TooManyRequestsException", "RequestThrottled",
                         "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500", "502", "504"})
_TRANSIENT_ERRNO = frozenset({errno.EBUSY, errno.EIO, errno.EAGAIN, errno.ECONNRESET, errno.ECONNABORTED,
                              errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.ENETUNREACH,
                              errno.EHOSTUNREACH, getattr(errno, "EREMOTEIO", 121)})


def is_transient(exc: BaseException) -> bool:
    """True for faults worth retrying (5xx, throttling, resets, timeouts), False for answers
    that will not change (missing, denied, bad data, bad request)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, FeatstoreError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status == 429 or response.get("Error", {}).get("Code") in _THROTTLING
    if isinstance(exc, OSError):
        return exc.errno is None or exc.errno in _TRANSIENT_ERRNO
    return False


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (with the service's error code and HTTP status when it
    answered), credentials and signed URLs masked."""
    text = f"{type(exc).__name__}: {str(exc) or repr(exc)}"
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = response["Error"].get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            text += f" ({code or 'error'}, HTTP {status or '?'})"
            break
    return secrets.redact(text)


def with_retries(fn: Callable[[], T], what: str | Callable[[], str], op: str, policy: RetryPolicy | None = None) -> T:
    """Run ``fn`` until it succeeds, retrying transient faults with backoff. ``what`` names the
    object (or is called to name it, when that is known only after a failure). A persistent
    fault raises ``StorageError``; a missing object raises ``FileNotFoundError``; anything else
    that is not transient propagates (as a redacted ``StorageError`` if it is an I/O error)."""
    policy = policy or RetryPolicy()
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified by _backoff, which raises what is final
            attempt += 1
            time.sleep(_backoff(exc, attempt, start, what, op, policy))


async def with_retries_async(fn: Callable[[], Awaitable[T]], what: str | Callable[[], str], op: str, policy: RetryPolicy | None = None) -> T:
    """``with_retries`` for a coroutine (one request of a concurrent batch): the same faults are
    retried and the same errors raised, and the backoff sleeps without blocking the others."""
    policy = policy or RetryPolicy()
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as exc:  # noqa: BLE001 - classified by _backoff, which raises what is final
            attempt += 1
            await asyncio.sleep(_backoff(exc, attempt, start, what, op, policy))


def _no_such_bucket(exc: BaseException) -> bool:
    # s3fs turns S3's NoSuchBucket into FileNotFoundError("The specified bucket does not exist").
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return "nosuchbucket" in text or ("bucket" in text and "does not exist" in text)


def _backoff(exc: Exception, attempt: int, start: float, what: str | Callable[[], str], op: str, policy: RetryPolicy) -> float:
    """Seconds to wait before trying again after ``exc`` (the ``attempt``-th failure), or raise
    what the caller should see when there is no retrying it."""

    def name() -> str:
        return secrets.redact(what() if callable(what) else what)

    if isinstance(exc, (FeatstoreError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        raise exc
    if isinstance(exc, FileNotFoundError):
        if _no_such_bucket(exc):  # the object store's own answer, not a missing object of a store
            raise StorageError(f"{name()}: {op} failed: the bucket does not exist; create it first, or check the URL") from None
        raise FileNotFoundError(errno.ENOENT, f"{op}: no such object", name()) from None
    if isinstance(exc, PermissionError):
        raise StorageError(f"{name()}: {op} was denied ({describe(exc)}); check the credentials and the bucket's permissions") from None
    elapsed = time.monotonic() - start
    if not is_transient(exc):
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _CLIENT_MODULES:
            raise StorageError(f"{name()}: {op} failed: {describe(exc)}") from None
        raise exc  # not an I/O problem: a bug, which must show as one
    if attempt >= policy.attempts or elapsed >= policy.deadline:
        raise StorageError(
            f"{name()}: {op} failed {attempt} time(s) over {elapsed:.1f}s, last with {describe(exc)}; "
            "the object store is unreachable or overloaded: try again later"
        ) from None
    delay = min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
    log.info("%s: %s failed (%s); retry %d in %.2fs", name(), op, describe(exc), attempt, delay)
    return delay
