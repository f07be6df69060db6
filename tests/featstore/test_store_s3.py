"""The store conformance suite against real S3 over HTTP (a moto server on 127.0.0.1). Writers
in other processes (the concurrent-writer and killed-writer tests) reach it through the standard
AWS variables the session sets."""

import pytest

from tests.featstore.conformance import StoreConformance


class TestS3Store(StoreConformance):
    shared_across_processes = True

    @pytest.fixture
    def url(self, s3_bucket) -> str:
        return f"{s3_bucket}/store"
