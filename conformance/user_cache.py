"""Where the kit keeps, per user, what it builds once and reuses: ``$XDG_CACHE_HOME/ggml-rpc-kit/<what>`` (or
``~/.cache/ggml-rpc-kit/<what>``).  Every entry is rebuilt when missing, so deleting the folder costs time only."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(what: str) -> Path:
    """The kit's folder for ``what`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ggml-rpc-kit" / what


__all__ = ["user_cache"]
