"""Retrying remote storage operations: which faults are transient, backoff, clear errors.

A transient fault (HTTP 5xx, throttling, connection reset or refused, timeout, a body cut short)
is tried again with exponential backoff and jitter, bounded in attempts and time; one that
persists fails with a ``StorageError`` naming the object. A missing object or a denied request
is an answer, not a fault, and fails at once. Messages never carry credentials or signed URLs.
The HTTP stacks under fsspec retry a little themselves; this layer is the one that decides.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from featstore import secrets
from featstore.errors import FeatstoreError, StorageError

log = logging.getLogger("featstore.storage")
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8           # tries of one operation, the first included
    base_delay: float = 0.1     # seconds before the first retry; doubles each time, with jitter
    max_delay: float = 5.0
    deadline: float = 120.0     # seconds after which an operation is not tried again


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

    def name() -> str:
        return secrets.redact(what() if callable(what) else what)

    while True:
        try:
            return fn()
        except (FeatstoreError, IsADirectoryError, NotADirectoryError, FileExistsError):
            raise
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{op}: no such object", name()) from None
        except PermissionError as exc:
            raise StorageError(f"{name()}: {op} was denied ({describe(exc)}); check the credentials and the bucket's permissions") from None
        except Exception as exc:  # noqa: BLE001 - classified below
            attempt += 1
            elapsed = time.monotonic() - start
            if not is_transient(exc):
                if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _CLIENT_MODULES:
                    raise StorageError(f"{name()}: {op} failed: {describe(exc)}") from None
                raise  # not an I/O problem: a bug, which must show as one
            if attempt >= policy.attempts or elapsed >= policy.deadline:
                raise StorageError(
                    f"{name()}: {op} failed {attempt} time(s) over {elapsed:.1f}s, last with {describe(exc)}; "
                    "the object store is unreachable or overloaded: try again later"
                ) from None
            delay = min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            log.info("%s: %s failed (%s); retry %d in %.2fs", name(), op, describe(exc), attempt, delay)
            time.sleep(delay)
