"""Process memory: the resident size of a process, and handing freed heap back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable


def rss_kib(pid: int | str = "self") -> int:
    """Resident set size of a process in KiB (0 where /proc is not available)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _libc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim() if sys.platform.startswith("linux") else None


def return_free_memory() -> None:
    """Hand freed heap pages back to the system between rounds.

    Buffers of every size come and go all campaign long; glibc keeps the freed ones in its heap (its mmap threshold
    rises after the first large free), which shows as a resident size creeping up although nothing is alive.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


__all__ = ["return_free_memory", "rss_kib"]
