"""Where a benchmark's client and server run: CPU placement for latency figures.

A request/reply figure on loopback measures more than the server when the two processes sit on different CPUs: a
sleeping process is woken by the other's message through an inter-processor interrupt, and on a virtual machine
whose idle CPU has been handed back to the host that costs tens of microseconds each way.  Measured on this kit's
2-CPU machine, GET_ALIGNMENT round trips with client and server on one CPU: about 75,000/s for upstream's C server
and for the reference alike; on two CPUs about 10,700/s for both.  Left to the scheduler, each server lands in one
mode or the other from run to run (upstream at 60,600/s and the reference at 10,800/s in one run, the reverse
order of magnitude in another): the figure then compares placements, not servers.  So round trips are measured in
both placements, chosen explicitly and alike for every server.

The server is found by its listening port (``/proc/net/tcp*`` gives the socket's inode, ``/proc/*/fd`` the process
holding it), so a server the bench did not start is placed too when its process is visible here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def _listening_inodes(port: int, proc: Path) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listener_pid(port: int, proc: Path = Path("/proc")) -> int | None:
    """The process listening on TCP ``port`` (any address), or None when none visible here is."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port, proc)}
    if not wanted:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # another user's process, or gone meanwhile
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    return int(entry.name)
            except OSError:
                continue
    return None


def _threads(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return [pid]


@contextlib.contextmanager
def placed(server_pid: int, server_cpus: set[int]) -> Iterator[None]:
    """Every thread of the server on ``server_cpus`` until the block ends; each thread's own affinity is restored
    afterwards (a thread that ended meanwhile is skipped)."""
    saved: dict[int, set[int]] = {}
    try:
        for tid in _threads(server_pid):
            with contextlib.suppress(ProcessLookupError):
                saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, server_cpus)
        yield
    finally:
        for tid, cpus in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def client_on(cpus: set[int]) -> Iterator[None]:
    """The calling thread on ``cpus`` until the block ends, then back where it was allowed before."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


__all__ = ["client_on", "listener_pid", "placed", "usable_cpus"]
