"""Which code a recorded figure was taken with: the git commit of a checkout and whether its tree was dirty.

Every record the kit writes (interop runs, per-op closeness, bench JSON) names its commit and says whether the tree
held uncommitted changes, so that a figure is credited to a commit only when it was taken with that commit's code.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The checkout holding the kit's own source (where its modules are, in an editable install or a clone).
KIT_ROOT = Path(__file__).resolve().parents[1]


def git_state(repo: Path | None = None, *, untracked: bool = False) -> tuple[str, bool | None]:
    """(short commit, dirty) of the checkout at ``repo`` (default: the kit's source, else the working directory: a
    clone the kit was installed from without ``-e``), or ("unknown", None) outside a git checkout.  ``dirty``:
    tracked files changed; with ``untracked``, untracked files count as changes too."""
    if repo is None:
        found = _state(KIT_ROOT, untracked)
        return found if found[0] != "unknown" else _state(Path.cwd(), untracked)
    return _state(repo, untracked)


def _state(where: Path, untracked: bool) -> tuple[str, bool | None]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=where,
                                timeout=10).stdout.strip()
        if not commit:
            return "unknown", None
        status = subprocess.run(["git", "status", "--porcelain", *([] if untracked else ["--untracked-files=no"])],
                                capture_output=True, text=True, cwd=where, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return commit, (bool(status.stdout.strip()) if status.returncode == 0 else None)
