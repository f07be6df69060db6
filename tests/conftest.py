"""Session fixtures shared by the test modules: a real S3 endpoint (moto) on 127.0.0.1."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _user_cache(tmp_path_factory):
    """The suite's user cache (XDG_CACHE_HOME, for this process and every one it starts): the
    encode runs' crash journals (precompute.runtime.crash_journal) go there, not into the real
    ~/.cache. (Models built for `path: tiny` follow MMCACHE_CACHE, which stays as it is.)"""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on a free loopback port, with the standard AWS variables pointing at it
    for this process and every process it starts (so no flags are needed, as for a user)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (`pip install -e .[dev]` installs it)")
    pytest.importorskip("s3fs", reason="s3fs is not installed (`pip install -e .[dev]` installs it)")
    from tests.s3_server import S3Server

    server = S3Server()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket: ``s3://<name>``."""
    return s3_server.make_bucket()
