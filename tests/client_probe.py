"""`mmcache encode` run as a user runs it, reporting on its way out every module it imported: how
the tests and benchmarks/encode_bench.py see that the client of an external cluster imports no
encoder or decoder library."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# What the client of an external cluster must not import: the encoders run on the workers (torch,
# transformers, diffusers), so does decoding (Pillow, PyAV), and ml_dtypes alone takes ~0.5 s to
# import while the client makes no array. Its start-up on a warm cluster is its imports.
NOT_IN_THE_CLIENT = ("torch", "transformers", "diffusers", "PIL", "av", "ml_dtypes")

# The command's own entry point; sys.modules goes to the file named by $MODULES_OUT.
_PROBE = """
import json, os, sys
from mmcache.precompute.cli import main
try:
    main()
finally:
    with open(os.environ["MODULES_OUT"], "w") as out:
        json.dump(sorted(sys.modules), out)
"""


def probed_command(*args: str) -> list[str]:
    """``mmcache encode ...`` (args after the program name) under the probe; run it with
    MODULES_OUT=FILE in its environment."""
    return [sys.executable, "-c", _PROBE, *args]


def imported(modules_out: str | Path) -> list[str]:
    """Every module the probed command imported."""
    return json.loads(Path(modules_out).read_text())


def not_in_the_client(modules: list[str]) -> list[str]:
    """The top-level packages of ``modules`` that the client must not import."""
    return sorted({m.split(".")[0] for m in modules} & set(NOT_IN_THE_CLIENT))
