"""The installed package carries every data file its modules load from beside themselves.

CI installs the kit without ``-e``: a data file missing from ``[tool.setuptools.package-data]`` is present in a
checkout and absent from the install, so the code silently takes its "no data" branch there.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import tomllib
from pathlib import Path

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
