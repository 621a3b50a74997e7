"""One version: pyproject.toml's, read through the installed package's metadata by ``--version`` and every report.

Releases are named by CHANGELOG.md's sections and git tags; the version being developed is the next release with a
``.dev0`` suffix, so an install from a checkout is never mistaken for the release it precedes.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from ggml_rpc.conformance import kit_version
from ggml_rpc.conformance.cli import main

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


@pytest.fixture
def installed_is_this_checkout() -> None:
    if kit_version() != PYPROJECT_VERSION:
        pytest.fail(f"the installed kit says {kit_version()}, pyproject.toml {PYPROJECT_VERSION}: reinstall "
                    "(pip install -e .) after changing the version")


def test_version_option_prints_pyproject_s_version(installed_is_this_checkout, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"ggml-rpc-kit {PYPROJECT_VERSION}\n"


def test_check_reports_name_pyproject_s_version(installed_is_this_checkout, capsys, tmp_path):
    sarif = tmp_path / "check.sarif"
    main(["check", "--checks", "HELLO-001", "--json", "-", "--sarif", str(sarif)])
    report = json.loads(capsys.readouterr().out)
    assert report["kit_version"] == PYPROJECT_VERSION
    [run] = json.loads(sarif.read_text())["runs"]
    assert run["tool"]["driver"]["version"] == PYPROJECT_VERSION


def _released() -> list[tuple[str, str]]:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, re.M)


def test_the_version_in_development_follows_the_last_release():
    """pyproject's version is the release after CHANGELOG.md's newest one, in development; Unreleased is on top."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.*)$", text, re.M)
    assert headings[0] == "[Unreleased]"
    released = _released()
    assert len(released) == len(headings) - 1, "every other section is a release: ## [X.Y.Z] - YYYY-MM-DD"
    versions = [tuple(int(n) for n in v.split(".")) for v, _ in released]
    assert versions == sorted(versions, reverse=True), "releases newest first, versions increasing"
    dates = [d for _, d in released]
    assert dates == sorted(dates, reverse=True)
    major, minor, _patch = versions[0]
    assert PYPROJECT_VERSION == f"{major}.{minor + 1}.0.dev0"


def test_each_release_is_a_tag_on_a_commit_of_its_day():
    """``vX.Y.Z`` names the commit that ends release X.Y.Z, committed on the date CHANGELOG.md gives it."""
    listed = subprocess.run(["git", "tag", "--list", "v*"], cwd=ROOT, capture_output=True, text=True, check=False)
    tags = set(listed.stdout.split())
    if listed.returncode != 0 or not tags:
        pytest.skip("no git checkout with the release tags (a tarball, or a clone without tags)")
    for version, date in _released():
        assert f"v{version}" in tags, f"release {version} has no tag v{version}"
        day = subprocess.run(["git", "log", "-1", "--format=%cd", "--date=short", f"v{version}"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        assert day == date, f"v{version} is a commit of {day}, CHANGELOG.md says {date}"
