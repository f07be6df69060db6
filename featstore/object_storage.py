"""Object-store storage through fsspec (``memory://``, ``s3://``, ...), whose single-object PUTs
are atomic and whose ``cat_ranges`` batches many ranged reads into few concurrent requests.

Remote operations are retried (featstore.retry); writes are batched (``write_many``), large
objects in parts, so a commit costs a few round trips (docs/design/store.md, "Object storage").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from . import secrets
from .errors import ConfigError, CorruptionError
from .retry import RetryPolicy, describe, is_transient, remote_filesystem, with_retries, with_retries_async
from .storage import ReadRequest, Storage, check_key

T = TypeVar("T")
log = logging.getLogger("mmcache.featstore.storage")


@dataclass(frozen=True)
class UploadPolicy:
    """How ``FsspecStorage.write_many`` uploads. The requests in flight at once come from the
    filesystem's own ``max_concurrency`` (an s3fs storage option, default 10) when it has one."""

    concurrency: int = 10             # requests in flight at once, per batch
    part_bytes: int = 16 << 20        # multipart part size (S3 needs at least 5 MiB)
    multipart_above: int = 32 << 20   # objects larger than this go up in parts


class FsspecStorage(Storage):
    retry = RetryPolicy()
    uploads = UploadPolicy()

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        secrets.register(storage_options)
        try:
            # featstore's retries are the only ones: s3fs's and botocore's are set to one attempt.
            self.fs, root = remote_filesystem(url, storage_options, self.retry)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open {secrets.redact_url(url)}: {describe(exc)}") from None
        self.root = root.rstrip("/")
        # s3fs: its async internals (listing without a probe of the parent, multipart calls)
        # save round trips; any other filesystem goes through fsspec's public API only.
        self._s3 = hasattr(self.fs, "_call_s3") and hasattr(self.fs, "_lsdir")
        protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, tuple) else self.fs.protocol
        self.url = secrets.redact_url(f"{protocol}://{self.root.removeprefix('/')}" if protocol != "memory" else f"memory://{self.root}")

    @property
    def is_remote(self) -> bool:
        return True

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key, self.url)}" if key else self.root

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        return with_retries(fn, self._where(key), op, self.retry)

    def read(self, key: str) -> bytes:
        # One GET: s3fs would first ask for the size (a HEAD per read) to fetch large objects
        # in concurrent ranges, which the objects read whole here (manifest, index parts) are not.
        kwargs = {"max_concurrency": 1} if self._s3 else {}
        return self._call("read", key, lambda: self.fs.cat_file(self._path(key), **kwargs))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        self.read_into([(key, ranges, out)])

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        # One flat list of ranges, fetched concurrently by cat_ranges; under faults only the
        # ranges that failed are fetched again.
        pieces = []  # (key, start, end, out view)
        for key, ranges, out in requests:
            view = memoryview(out).cast("B")
            pos = 0
            for start, end in ranges:
                pieces.append((key, start, end, view[pos : pos + end - start]))
                pos += end - start
        pending = [p for p in pieces if p[2] > p[1]]
        if not pending:
            return

        def attempt() -> None:
            nonlocal pending
            blobs = self.fs.cat_ranges([self._path(p[0]) for p in pending], [p[1] for p in pending], [p[2] for p in pending], on_error="return")
            failed, first = [], None
            for piece, blob in zip(pending, blobs, strict=True):
                key, start, end, view = piece
                if isinstance(blob, BaseException):
                    failed.append(piece)
                    if first is None or (is_transient(first[1]) and not is_transient(blob)):
                        first = (key, blob)  # a permanent failure decides: no retry
                    continue
                if len(blob) != end - start:
                    raise CorruptionError(f"{self._where(key)}: expected {end - start} bytes at offset {start}, got {len(blob)} (truncated)")
                view[:] = blob
            pending = failed
            if first is not None:
                where[0] = first[0]
                raise first[1]

        where = [pending[0][0]]
        with_retries(attempt, lambda: self._where(where[0]), "read", self.retry)

    def get_file(self, key: str, local_path: str) -> None:
        """Download a whole object to a local file (streamed, not held in memory)."""
        self._call("read", key, lambda: self.fs.get_file(self._path(key), local_path))

    def write_atomic(self, key: str, data: bytes) -> None:
        # One PUT: object stores (and the in-memory fs) publish it whole or not at all. A retry
        # after a lost response PUTs the same bytes again, which changes nothing.
        payload = bytes(data)
        self._call("write", key, lambda: self.fs.pipe_file(self._path(key), payload))

    # Backends whose PUT can be made conditional (If-None-Match: * on S3; an exclusive open in
    # memory). Elsewhere write_new checks, then writes: not atomic, but every object name a writer
    # creates besides the commit record is unique to it (see featstore.writer).
    _CONDITIONAL_PUT = ("s3", "s3a", "memory")

    def write_new(self, key: str, data: bytes) -> bool:
        payload, path = bytes(data), self._path(key)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)

        def create() -> bool:
            try:
                if any(p in self._CONDITIONAL_PUT for p in protocols):
                    self.fs.pipe_file(path, payload, mode="create")
                elif self.fs.exists(path):
                    raise FileExistsError(path)
                else:
                    self.fs.pipe_file(path, payload)
                return True
            except FileExistsError:
                self.fs.invalidate_cache(path)
                return self.fs.cat_file(path) == payload

        return self._call("write", key, create)

    def delete(self, key: str) -> None:
        path = self._path(key)

        def remove() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", key, remove)

    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        parts = list(parts)  # a retry writes them again from the start

        def write() -> None:
            with self.fs.open(self._path(key), "wb") as fh:
                for part in parts:
                    fh.write(part)

        self._call("write", key, write)

    def write_many(self, objects: Sequence[tuple[str, Sequence[Any]]]) -> None:
        if not getattr(self.fs, "async_impl", False) or not hasattr(self.fs, "_pipe_file"):
            return super().write_many(objects)  # a synchronous filesystem (memory://): in turn
        from fsspec.asyn import sync

        sync(self.fs.loop, self._upload_all, list(objects))

    async def _upload_all(self, objects: list[tuple[str, Sequence[Any]]]) -> None:
        limit = asyncio.Semaphore(max(1, int(getattr(self.fs, "max_concurrency", 0) or self.uploads.concurrency)))
        # Every upload runs to its end (none is left running behind a raised error); the first
        # failure is then raised.
        results = await asyncio.gather(*(self._upload(limit, key, parts) for key, parts in objects), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _upload(self, limit: asyncio.Semaphore, key: str, parts: Sequence[Any]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        if self._s3 and size > self.uploads.multipart_above:
            return await self._upload_in_parts(limit, key, views, size)
        data = b"".join(views)
        async with limit:
            # A retry after a lost answer PUTs the same bytes again, which changes nothing.
            await with_retries_async(lambda: self.fs._pipe_file(self._path(key), data), self._where(key), "write", self.retry)

    async def _upload_in_parts(self, limit: asyncio.Semaphore, key: str, views: list[memoryview], size: int) -> None:
        """An S3 multipart upload, each part retried on its own: a fault costs one part, not
        the object. The object appears whole at completion, or not at all."""
        bucket, path, _ = self.fs.split_path(self._path(key))
        where, step = self._where(key), max(5 << 20, self.uploads.part_bytes)

        def s3(method: str, **kwargs: Any) -> Callable[[], Any]:
            return lambda: self.fs._call_s3(method, Bucket=bucket, Key=path, **kwargs)

        async with limit:
            upload = (await with_retries_async(s3("create_multipart_upload"), where, "write", self.retry))["UploadId"]

        async def put_part(number: int, start: int) -> dict[str, Any]:
            async with limit:  # a part's bytes are joined only once it may be sent
                body = _joined_range(views, start, min(size, start + step))
                out = await with_retries_async(s3("upload_part", UploadId=upload, PartNumber=number, Body=body), f"{where} (part {number})", "write", self.retry)
            return {"PartNumber": number, "ETag": out["ETag"]}

        try:
            results = await asyncio.gather(*(put_part(i + 1, start) for i, start in enumerate(range(0, size, step))), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            tried = [0]

            async def complete() -> None:
                tried[0] += 1
                try:
                    await s3("complete_multipart_upload", UploadId=upload, MultipartUpload={"Parts": results})()
                except Exception as exc:
                    # A retry whose first answer was lost: the upload is complete and gone. The
                    # key is this writer's own, so the object there is the one just completed.
                    if tried[0] > 1 and isinstance(exc, FileNotFoundError) and (await self.fs._info(self._path(key), refresh=True))["size"] == size:
                        return
                    raise

            async with limit:
                await with_retries_async(complete, where, "write", self.retry)
        except BaseException:
            try:  # the parts uploaded so far would otherwise be kept (and billed) by the service
                await s3("abort_multipart_upload", UploadId=upload)()
            except Exception as exc:  # noqa: BLE001 - the upload's own failure is what is raised
                log.warning("%s: could not abort the multipart upload (%s); a lifecycle rule removes it", where, describe(exc))
            raise
        finally:
            self.fs.invalidate_cache(self._path(key))

    def exists(self, key: str) -> bool:
        path = self._path(key)

        def probe() -> bool:
            self.fs.invalidate_cache(path)  # s3fs may answer from a stale listing
            try:
                if self._s3:
                    # One HEAD: s3fs's info() follows a miss with a listing (is it a directory?),
                    # and a key here is always an object's.
                    bucket, name, _ = self.fs.split_path(path)
                    self.fs.call_s3("head_object", Bucket=bucket, Key=name)
                else:
                    self.fs.info(path)
            except FileNotFoundError:
                return False
            return True

        return self._call("stat", key, probe)

    def size(self, key: str) -> int:
        path = self._path(key)

        def stat() -> int:
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

        return self._call("stat", key, stat)

    def list_entries(self, prefix: str) -> list[dict[str, Any]]:
        """fsspec's detailed entries directly under ``prefix`` (its own entry left out; empty if it
        does not exist), listed afresh and retried. On S3 one request per 1,000 names: s3fs's
        ls() lists the parent too when a folder is empty (to tell an empty one from a file), a
        second request for every new store's empty folders."""
        path = self._path(prefix)

        def listing() -> list[dict[str, Any]]:
            # Listings are cached by some filesystems (s3fs); a reader must see fresh commits.
            self.fs.invalidate_cache(path)
            try:
                if self._s3:
                    from fsspec.asyn import sync

                    entries = sync(self.fs.loop, self.fs._lsdir, path, refresh=True)
                else:
                    entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
            return [e for e in entries if e["name"].rstrip("/") != path.rstrip("/")]

        return self._call("list", prefix, listing)

    def list_fingerprints(self, prefix: str) -> dict[str, str]:
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: _fingerprint(e) for e in self.list_entries(prefix) if e.get("type") != "directory"}

    def list_dir(self, prefix: str) -> list[str]:
        return sorted({e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.list_entries(prefix)})

    def list_names(self, prefix: str, start: str) -> list[str]:
        # Object stores filter by key prefix on the server (s3fs: find(prefix=...)): asking
        # whether one shard is committed must not page through every index part of the store.
        import inspect

        if "prefix" not in inspect.signature(self.fs.find).parameters:
            return super().list_names(prefix, start)
        path = self._path(prefix)

        def listing() -> list[str]:
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.find(path, maxdepth=1, prefix=start)
            except FileNotFoundError:
                return []
            return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

        return self._call("list", prefix, listing)


def _joined_range(views: list[memoryview], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the concatenation of ``views``."""
    out, pos = [], 0
    for view in views:
        lo, hi = max(start, pos), min(end, pos + view.nbytes)
        if lo < hi:
            out.append(view[lo - pos : hi - pos])
        pos += view.nbytes
        if pos >= end:
            break
    return b"".join(out)


def _fingerprint(entry: dict[str, Any]) -> str:
    # S3 and GCS give a content hash (the ETag of a single PUT is its MD5); others a time stamp.
    tag = next((entry[k] for k in ("ETag", "etag", "md5Hash", "crc32c", "mtime", "LastModified", "created") if entry.get(k) is not None), "")
    return f"{entry.get('size')}:{tag}"
