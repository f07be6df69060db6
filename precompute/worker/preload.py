"""Run in each worker process of the local cluster as it starts (``distributed.worker.preload``:
``runtime.local_cluster.PRELOAD``). Ctrl-C in a terminal reaches the whole process group,
and so may SIGTERM (``kill -- -PGID``, a service manager stopping the command): the workers would
die of it mid-task, and their nannies start them again, while the client stops the job at a
sample boundary (``runtime.interrupt``) and closes them itself once their tasks have committed.
A worker whose client is gone ends all the same (Dask's nanny watches its parent)."""

from __future__ import annotations

import signal
import threading
from typing import Any


def dask_setup(worker: Any) -> None:
    if threading.current_thread() is threading.main_thread():  # where a worker process runs its loop
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
