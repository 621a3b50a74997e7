"""numba's on-disk cache of the compiled kernels, kept in step with every source file they are built from.

numba keys a cached kernel on its own file's time stamp and size only: a kernel in one module that inlines an
intrinsic or a helper from another (``compiled.tinyblas`` and ``lanes8``'s tiles, the attention loops and
``cmath32``) keeps its stale machine code when only the other module changes, silently.  :func:`refresh` drops
the in-tree cache whenever any source file of the executor changed since the cache was written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_STAMP = "kernels.sources.sha256"


def sources_digest(directory: Path) -> str:
    """The SHA-256 of every ``.py`` file in ``directory``, names and contents, in name order."""
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def refresh(directory: Path) -> bool:
    """Remove numba's cached kernels in ``directory/__pycache__`` when the sources differ from the ones they were
    compiled from (recorded there); returns whether it removed them.  A read-only install (numba then caches
    elsewhere, or not at all) is left as it is."""
    cache = directory / "__pycache__"
    digest = sources_digest(directory)
    stamp = cache / _STAMP
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for path in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            path.unlink(missing_ok=True)
        stamp.write_text(digest)
    except OSError:
        return False
    return True
