"""The commit and tree state every recorded figure is credited to (conformance/provenance.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ggml_rpc.bench.runner import machine
from ggml_rpc.conformance.provenance import git_state


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=kit", "-c", "user.email=kit@localhost", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_a_checkout_is_clean_until_a_tracked_file_changes(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert git_state(tmp_path) == (head, False)
    (tmp_path / "new.txt").write_text("untracked\n")
    assert git_state(tmp_path) == (head, False)
    assert git_state(tmp_path, untracked=True) == (head, True)
    (tmp_path / "a.txt").write_text("two\n")
    assert git_state(tmp_path) == (head, True)


def test_outside_a_checkout_the_commit_is_unknown(tmp_path: Path) -> None:
    assert git_state(tmp_path) == ("unknown", None)


def test_bench_records_name_their_commit_and_tree() -> None:
    info = machine()
    assert isinstance(info["commit"], str) and info["commit"]
    assert info["dirty"] in (True, False, None)


def test_an_installed_kit_outside_any_checkout_names_the_clone_it_runs_in(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from ggml_rpc.conformance import provenance

    clone, elsewhere = tmp_path / "clone", tmp_path / "site-packages"
    clone.mkdir()
    elsewhere.mkdir()
    _git(clone, "init", "-q")
    (clone / "a.txt").write_text("one\n")
    _git(clone, "add", "a.txt")
    _git(clone, "commit", "-q", "-m", "first")
    monkeypatch.setattr(provenance, "KIT_ROOT", elsewhere)
    monkeypatch.chdir(clone)
    assert git_state() == (_git(clone, "rev-parse", "--short", "HEAD"), False)
