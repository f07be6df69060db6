"""The house as a user installs it: import names live under ``mmcache.`` and nothing else is
installed at top level, so a user's own ``train.py`` or another package named ``train`` cannot
shadow ours. The house rules read from the code (functions, import cycles, README, docs) are
checked by ``../shared/tools/house_check.py`` where the checkout has it beside it."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOUSE_CHECK = ROOT.parent / "shared" / "tools" / "house_check.py"


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_import_names_live_under_mmcache_outside_the_checkout(tmp_path):
    # A user's own train.py in the working directory must not hide the trainer.
    (tmp_path / "train.py").write_text("raise SystemExit('the user script ran instead of mmcache')\n")
    ok = run_python("import mmcache.train.cli, mmcache.featstore, mmcache.precompute.cli; print(mmcache.featstore.__name__)", tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "mmcache.featstore"
    for old in ("featstore", "precompute"):
        gone = run_python(f"import {old}", tmp_path)
        assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr, (old, gone.stderr)
    cli = subprocess.run([sys.executable, "-m", "mmcache.train.cli", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "mmtrain" in cli.stdout, cli.stderr


def test_the_wheel_installs_nothing_but_mmcache_at_top_level(tmp_path):
    src = tmp_path / "src"
    for name in ("featstore", "precompute", "train", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("__init__.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel")],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"mmcache", "mmcache-0.1.0.dist-info", "mmcache-0.1.0.data"}, top
    packages = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    on_disk = {"mmcache"} | {"mmcache/" + str(p.parent.relative_to(ROOT)) for pkg in ("featstore", "precompute", "train") for p in (ROOT / pkg).glob("**/__init__.py")}
    assert packages == on_disk, "pyproject.toml's package list must name every subpackage"


@pytest.mark.skipif(not HOUSE_CHECK.exists(), reason="../shared/tools/house_check.py is not beside this checkout")
def test_house_rules():
    result = subprocess.run([sys.executable, str(HOUSE_CHECK), str(ROOT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


PACKAGES = {"featstore": "mmcache.featstore", "precompute": "mmcache.precompute", "train": "mmcache.train"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file names in an import, lazy ones included, as absolute dotted names."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    package = parts if rel.name == "__init__" else parts[:-1]
    package = [p for p in ".".join(package).split(".") if p != "__init__"]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("mmcache."):
            names.add(node.value)  # importlib.import_module("mmcache...") and the like
    return names


def importers_of(package: str, target: str) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / package).glob("**/*.py")):
        hits = sorted(n for n in imported_modules(path) if n == target or n.startswith(target + "."))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    return found


def test_train_reaches_precompute_through_one_seam():
    found = importers_of("train", "mmcache.precompute")
    assert set(found) == {"train/encoding.py"}, f"train imports mmcache.precompute only in train/encoding.py; also in {sorted(set(found) - {'train/encoding.py'})}"


def test_dependencies_run_one_way():
    assert importers_of("precompute", "mmcache.train") == {}, "precompute never imports train"
    assert importers_of("featstore", "mmcache.precompute") == {} and importers_of("featstore", "mmcache.train") == {}, "the store imports neither stage"


def test_the_distribution_imports_itself_relatively():
    # An absolute mmcache.* import names no file of this tree: tools that read imports by folder
    # would draw no arrow for it, and the house they show would miss a way between its rooms.
    absolute = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("**/*.py")):
            tree = ast.parse(path.read_text(), str(path))
            lines = [node.lineno for node in ast.walk(tree) if is_absolute_mmcache_import(node)]
            if lines:
                absolute[str(path.relative_to(ROOT))] = lines
    assert absolute == {}, f"import the distribution's own modules relatively (from ..featstore.errors import ...): {absolute}"


def is_absolute_mmcache_import(node) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "mmcache" for alias in node.names)
    return isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mmcache"
