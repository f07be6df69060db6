"""The Dask worker plugin that holds a worker's loaded encoders across jobs.

Registered by every job on its cluster (idempotent: a job finding it there keeps it, and the
encoders in it), so on a long-lived ``--scheduler`` cluster the second job's workers answer from
memory instead of loading the models again; workers that join later (a nanny's restart of a
killed one included) get it too. Imports ``distributed``: only the Dask executors import this.
"""

from __future__ import annotations

from typing import Any

from distributed import WorkerPlugin, get_worker

from .encoder_cache import PROCESS_ENCODERS, EncoderCache

PLUGIN_NAME = "mmcache-encoders"


class EncoderPlugin(WorkerPlugin):
    idempotent = True  # registering it again (the next job) leaves the worker's loaded one in place
    name = PLUGIN_NAME

    def __init__(self) -> None:
        # Made on the worker (setup): the plugin travels there pickled, and a cache holds a lock.
        self.cache: EncoderCache | None = None

    def setup(self, worker: Any) -> None:
        self.cache = EncoderCache()

    def teardown(self, worker: Any) -> None:
        if self.cache is not None:
            self.cache.clear()


def worker_cache() -> EncoderCache:
    """The running worker's encoder cache (the process's own on a worker without the plugin)."""
    plugin = get_worker().plugins.get(PLUGIN_NAME)
    return plugin.cache if isinstance(plugin, EncoderPlugin) and plugin.cache is not None else PROCESS_ENCODERS


def encoder_loads(dask_worker: Any) -> int:
    """Models the plugin of ``dask_worker`` has loaded (``client.run(encoder_loads)``): 0 without it."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return plugin.cache.loads if isinstance(plugin, EncoderPlugin) and plugin.cache is not None else 0
