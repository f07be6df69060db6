import uuid

import fsspec
import pytest

from tests.featstore.conformance import StoreConformance


class TestMemoryStore(StoreConformance):
    # memory:// lives inside one process: concurrency and crashes are exercised with threads
    # and exceptions instead of processes.
    shared_across_processes = False

    @pytest.fixture
    def url(self):
        name = f"test-{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}"
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)
