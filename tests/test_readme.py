"""The README's quick starts, run as a new user would: each code block after a
``<!-- quickstart -->`` marker, in order, in one fresh folder, with this environment's
``mmcache`` / ``mmtrain`` on PATH. So the first thing a newcomer copies cannot rot."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- quickstart -->\n```(bash|python)\n(.*?)```", re.S)


def quick_starts() -> list[tuple[str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_the_readme_has_three_quick_starts():
    assert [lang for lang, _ in quick_starts()] == ["bash", "bash", "python"]


def test_the_readme_quick_starts_run(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for lang, code in quick_starts():
        command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{lang} quick start failed:\n{code}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert (tmp_path / "runs" / "dit" / "model.safetensors").exists()
    assert (tmp_path / "runs" / "vlm" / "model.safetensors").exists()
    assert "4 sample-0" in result.stdout
