"""Which storage a store's URL gets: a local path (or ``file://``) goes to the OS
(``featstore.local_storage``), anything else through fsspec (``featstore.object_storage``)."""

from __future__ import annotations

import os
from typing import Any

from .local_storage import LocalStorage
from .object_storage import FsspecStorage
from .storage import Storage


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    text = os.fspath(url)
    if "://" not in text or text.startswith("file://"):
        return LocalStorage(text.removeprefix("file://"))
    return FsspecStorage(text, storage_options or {})
