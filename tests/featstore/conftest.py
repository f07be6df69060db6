"""Fixtures shared by the store's tests."""

from __future__ import annotations

import uuid

import fsspec
import pytest


@pytest.fixture(params=["local", "memory", "s3"])
def url(request, tmp_path):
    """An empty store's URL on each backend: a local path, memory:// and S3 (the tests' moto server)."""
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "memory":
        name = f"store-{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}"
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)
    else:
        yield f"{request.getfixturevalue('s3_bucket')}/store"
