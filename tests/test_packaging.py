"""The installed package carries every data file its modules load from beside themselves.

CI installs the kit without ``-e``: a data file missing from ``[tool.setuptools.package-data]`` is present in a
checkout and absent from the install, so the code silently takes its "no data" branch there.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _config() -> tuple[dict[str, str], dict[str, list[str]]]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    return tool["package-dir"], tool.get("package-data", {})


def _data_names(module: Path) -> set[str]:
    """String literals in ``module`` that name a non-Python file in the module's own folder."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        value = node.value if isinstance(node, ast.Constant) else None
        # Only short, plain file names: docstrings and messages are string constants too.
        if isinstance(value, str) and re.fullmatch(r"[\w.-]{1,100}\.\w+", value) and not value.endswith(".py"):
            if (module.parent / value).is_file():
                names.add(value)
    return names


def test_every_file_a_module_loads_from_its_folder_is_package_data():
    package_dir, package_data = _config()
    missing = []
    checked = 0
    for package, folder in package_dir.items():
        if not folder:
            continue
        for module in sorted((ROOT / folder).glob("*.py")):
            for name in _data_names(module):
                checked += 1
                if not any(fnmatch.fnmatch(name, glob) for glob in package_data.get(package, [])):
                    missing.append(f"{package}: {name} (loaded by {module.relative_to(ROOT)})")
    assert checked >= 4, "the scan found none of the known data files (op_counts.json, runtime.lua, ...)"
    assert not missing, "add to [tool.setuptools.package-data]: " + "; ".join(missing)


#: What a user downloads: the kit's code and the data its commands load, not the test fixtures (tens of MB).
WHEEL_LIMIT = 10 * 1000 * 1000


def _source_copy(dest: Path) -> Path:
    """The project's files (those git tracks, in a checkout; else the whole tree but virtual environments)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if tracked.returncode == 0 and tracked.stdout:
        for name in tracked.stdout.decode().split("\0"):
            if name and (ROOT / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest / name)
    else:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".venv*", "build", "__pycache__", "*.egg-info"))
    return dest


def test_the_wheel_stays_small_and_carries_no_fixture(tmp_path):
    """Built as a user's ``pip install`` builds it: the wheel has every package and no capture from fixtures/."""
    if importlib.util.find_spec("build") is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs the test extra, which has `build`")
        pytest.skip("`build` is not installed (pip install '.[test]')")
    # From a copy of the source: a build in the checkout leaves build/lib behind, whose stale modules a later
    # wheel would carry.
    source = _source_copy(tmp_path / "src")
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(source)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    assert wheel.stat().st_size <= WHEEL_LIMIT, f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB"
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".pcap", ".pcapng"))], "a capture reached the wheel"
    package_dir, _ = _config()
    for package in package_dir:
        assert f"{package.replace('.', '/')}/__init__.py" in names, f"{package} is missing from the wheel"
    # The data files the modules load (the other test of this file) are there too.
    assert "ggml_rpc/spec/PROTOCOL.md" in names and "ggml_rpc/spec/render/runtime.lua" in names
