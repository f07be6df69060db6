import pytest

from tests.featstore.conformance import StoreConformance


class TestLocalStore(StoreConformance):
    shared_across_processes = True

    @pytest.fixture
    def url(self, tmp_path) -> str:
        return str(tmp_path / "store")


class TestFileUrlStore(StoreConformance):
    shared_across_processes = True

    @pytest.fixture
    def url(self, tmp_path) -> str:
        return f"file://{tmp_path / 'store'}"
