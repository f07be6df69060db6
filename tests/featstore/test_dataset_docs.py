"""docs/dataset.md's loops, run as a user copies them: every block after a ``<!-- runs -->``
marker, in order, in one fresh folder (the first writes the store the others train from)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "dataset.md"
BLOCK = re.compile(r"<!-- runs -->\n```python\n(.*?)```", re.S)


def test_the_any_loop_recipes_run(tmp_path):
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) == 3  # the store, a plain loop, a diffusers-style loop
    outputs = []
    for code in blocks:
        result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{code}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        outputs.append(result.stdout)
    assert "epoch 1: loss" in outputs[1]
    assert "steps: 6 loss:" in outputs[2]  # 24 samples, batches of 4: every sample once
