"""The launch files in jobs/ give external Dask workers the settings run_encode gives a
LocalCluster's workers (precompute.runtime.local_cluster.WORKER_CONFIG), read the way Dask reads them."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmcache.precompute.runtime.local_cluster import WORKER_CONFIG

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def sbatch_dask_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if re.match(r"\s*export DASK_", line):
            for word in shlex.split(line)[1:]:
                name, _, value = word.partition("=")
                env[name] = value
    return env


def k8s_dask_env(path: Path) -> dict[str, str]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    config_maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "mmcache-env"]
    assert len(config_maps) == 1, "the encode manifest has one ConfigMap of worker environment"
    return {k: str(v) for k, v in config_maps[0]["data"].items() if k.startswith("DASK_")}


@pytest.mark.parametrize(
    ("name", "read_env"),
    [("dask-slurm-encode.sbatch", sbatch_dask_env), ("dask-k8s-encode.yaml", k8s_dask_env)],
)
def test_external_workers_get_the_local_cluster_settings(name, read_env):
    env = read_env(JOBS / name)
    assert env, f"{name} exports no DASK_* settings"
    # A fresh interpreter with that environment, as a worker started by the file reads its config.
    probe = "import json, dask, distributed; print(json.dumps({k: dask.config.get(k) for k in %r}))" % (
        [*WORKER_CONFIG, "distributed.nanny.pre-spawn-environ.OMP_NUM_THREADS"],
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    out = subprocess.run([sys.executable, "-c", probe], env={**clean, **env}, capture_output=True, text=True, check=True).stdout
    seen = json.loads(out)
    for key, value in WORKER_CONFIG.items():
        assert seen[key] == value, f"{name}: {key} is {seen[key]!r}, should be {value!r}"
    # The nanny keeps its other pre-spawn settings (the environment updates keys, not the mapping).
    assert seen["distributed.nanny.pre-spawn-environ.OMP_NUM_THREADS"] == 1
