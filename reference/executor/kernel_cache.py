"""numba's on-disk cache of the compiled kernels, kept in step with every source file they are built from.

numba keys a cached kernel on its own file's time stamp and size only: a kernel in one module that inlines an
intrinsic or a helper from another (``float_kernels.tinyblas`` and ``lanes8``'s tiles, the attention loops and
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


def preload() -> tuple[int, int]:
    """Load every compiled kernel this machine's cache holds for the executor (each signature a former run
    compiled), so that a long-lived server's first graph does not pay for it (0.1-0.2 s a kernel, a second or more
    for a model's first prompt).  Entries compiled for another CPU or from other sources are skipped, never
    compiled.  Returns (kernels loaded, entries skipped).  Reads numba's cache index through its internals: on a
    numba whose cache is laid out otherwise it loads nothing, and the kernels load at their first call as before."""
    import importlib
    import pkgutil

    from numba.core.registry import CPUDispatcher

    package = __name__.rpartition(".")[0]
    loaded = skipped = 0
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        for kernel in vars(module).values():
            if not isinstance(kernel, CPUDispatcher) or kernel.__module__ != module.__name__ or not kernel._cache:
                continue
            try:
                cache = kernel._cache
                codegen = kernel.targetctx.codegen()
                keys = list(cache._cache_file._load_index())
                usable = [key[0] for key in keys if key == cache._index_key(key[0], codegen)]
            except (AttributeError, OSError, TypeError, ValueError):
                return loaded, skipped
            skipped += len(keys) - len(usable)
            for signature in usable:
                kernel.compile(signature)  # found in the cache: loaded, not compiled
                loaded += 1
    return loaded, skipped
