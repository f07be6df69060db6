"""The in-process executor's crash journal (precompute.runtime.crash_journal): a journal left by a dead
process (a real one, SIGKILLed) sends the next run on the store to worker processes, unless the
user chose the executor; a live run's, another host's, a clean or a Python-level end are not
deaths. Real processes and files under a temporary XDG_CACHE_HOME."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from mmcache.precompute.runtime import crash_journal
from mmcache.precompute.runtime.placement import choose_placement
from tests.test_encode import tiny_config


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "mmcache" / "journals"


def die_in_task(url: str, shard: str) -> int:
    """A real process that journals a run on ``url`` and is SIGKILLed with ``shard`` in flight."""
    code = textwrap.dedent(f"""
        import os, signal
        from mmcache.precompute.runtime import crash_journal
        journal = crash_journal.Journal({url!r})
        with journal.running({shard!r}):
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, stderr
    return proc.pid


def placement(url: str, *overrides: str, workers: int | None = None) -> str:
    config = tiny_config("device=cpu", *overrides)
    return choose_placement(config, scheduler=None, workers=workers, output_url=url, samples=lambda: 5).kind


def test_a_run_killed_mid_task_sends_the_next_to_worker_processes_until_one_finishes(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pid = die_in_task("./store", "t-abc")
    died = crash_journal.previous_death(str(tmp_path / "store"))  # the same store, named by its absolute path
    assert f"process {pid}" in died and "t-abc" in died and "isolates tasks in worker processes" in died, died
    assert placement("store") == "processes"
    # A choice the user made stands.
    assert placement("store", "run.executor=threads") == "threads" and placement("store", workers=1) == "processes"
    assert placement(str(tmp_path / "other")) == "threads"  # another store's run is no concern of this one
    # Nothing of the store's URL in the journal, only its hash in the name.
    (path,) = cache.glob("*.json")
    assert "store" not in path.read_text() and path.name.startswith(crash_journal.store_key("./store"))
    crash_journal.forget_deaths("file://" + str(tmp_path / "store"))  # a run on it finished cleanly
    assert not list(cache.iterdir()) and placement("store") == "threads"


def test_a_live_run_a_clean_end_an_error_and_another_host_are_not_deaths(cache):
    url = "s3://bucket/store"
    with crash_journal.kept(url) as journal, journal.running("t-1"):
        (record,) = [json.loads(p.read_text()) for p in cache.glob("*.json")]
        assert record["pid"] == os.getpid() and record["tasks"] == ["t-1"]
        assert crash_journal.previous_death(url) == ""  # this very process: alive
    assert not list(cache.iterdir())
    with pytest.raises(ZeroDivisionError), crash_journal.kept(url):
        1 / 0  # a Python-level error: the process lives on to say why, no journal is left
    assert not list(cache.iterdir())
    # Another host's journal (a home shared over NFS): its pid means nothing here; left alone.
    other = cache / f"{crash_journal.store_key(url)}-1-1.json"
    other.write_text(json.dumps({"pid": 1, "started": 0, "host": socket.gethostname() + "-other", "tasks": ["t-2"]}))
    assert crash_journal.previous_death(url) == ""
    crash_journal.forget_deaths(url)
    assert other.exists()


def test_a_reused_pid_and_a_damaged_journal(cache):
    url = "s3://bucket/store"
    key = crash_journal.store_key(url)
    cache.mkdir(parents=True)
    # This process's pid, but not its start time: the pid was reused after the journal's run died.
    reused = cache / f"{key}-{os.getpid()}-5.json"
    reused.write_text(json.dumps({"pid": os.getpid(), "started": 5.0, "host": socket.gethostname(), "tasks": []}))
    assert f"process {os.getpid()}) died before its tasks ran" in crash_journal.previous_death(url)
    damaged = cache / f"{key}-7-7.json"
    damaged.write_text("{not json")
    crash_journal.forget_deaths(url)
    assert not list(cache.iterdir())


def test_a_journal_that_cannot_be_written_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # no folder can be made under a file
    with pytest.warns(RuntimeWarning, match="cannot keep the crash journal"), crash_journal.kept("s3://b/s") as journal:
        with journal.running("t-1"):
            pass
    assert journal.path is None
