"""The kit's end of a fork server: a spawned server whose deaths cost a fork, not a process start.

The kit preloads its fork server (``forkserver.c``, compiled here on first use) into a server it spawns. The first
time the server calls ``accept()`` it becomes a *supervisor* that forks the actual server off and, at each death,
reports the child's exit status, refuses connections (as a dead process does) and, when the kit restarts the
server, forks a fresh copy of itself as it was at that first ``accept()``: past its backend start, with nothing of
any connection in it. To the kit everything looks as with a process it restarts: a death has an exit status and a
log of its own; only the restart is a fork.

:class:`ForkServer` reads the supervisor's report lines out of the server's output (the caller feeds every line)
and tells the target what its child is doing. The supervisor writes a child's end after everything the child wrote,
so the lines between a child's start and its end are that child's log.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..user_cache import user_cache

#: The variable that makes the preloaded library a fork server: ``TOKEN:FD`` (FD: the kit's control pipe).
ENV = "GGML_RPC_KIT_FORK_SERVER"
#: What starts every line the supervisor writes (followed by the run's token).
MARK = "ggml-rpc-kit-fork-server"
#: The supervisor's exit status when it cannot go on (``forkserver.c``: KIT_FAILED).
FAILED_STATUS = 70
#: Lines of a child's output kept for its death report (as a spawned process's log tail).
LOG_LINES = 20

_SOURCE = "forkserver.c"


class ForkServerUnavailable(Exception):
    """The fork server cannot be used here (the message says why); the server runs as a plain process."""


def cache_dir() -> Path:
    """Where the compiled library is kept (``$XDG_CACHE_HOME/ggml-rpc-kit/fork-server``)."""
    return user_cache("fork-server")


def library() -> Path:
    """The preload library, compiled from this package's source on first use (named by the source's hash, so an
    updated source is compiled again and concurrent kits never see a half-written file)."""
    source = resources.files("ggml_rpc.conformance.harness").joinpath(_SOURCE).read_bytes()
    out = cache_dir() / f"libggml-rpc-kit-fork-server-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.is_file():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ForkServerUnavailable("no C compiler to build the fork server (apt-get install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    src = out.with_name(f"{out.name}.{os.getpid()}.c")
    src.write_bytes(source)
    try:
        # Upstream's symbols are taken at run time (dlsym): no header or library of any server is linked.
        p = subprocess.run([cc, "-O2", "-fPIC", "-shared", "-Wall", "-o", str(tmp), str(src), "-ldl"],
                           capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise ForkServerUnavailable(f"compiling the fork server failed: {p.stderr.strip()[:300]}")
        tmp.replace(out)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out


def wait_status(status: int) -> int:
    """``waitpid()``'s status word as a ``subprocess`` return code (negative: the signal that killed it)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


@dataclass
class Child:
    """One copy of the server the supervisor forked."""

    number: int
    pid: int
    #: :class:`~.sanitizer_log.SanitizerLog`'s count when the child started: its own reports come after.
    sanitizer_mark: int = 0
    log: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    #: Its return code once it has ended (``subprocess`` convention), else None.
    code: int | None = None


class ForkServer:
    """What one server process's supervisor has said, and the pipe the kit tells it to fork again through.

    Thread-safe: a reader thread feeds lines, the kit's thread asks and waits.
    """

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self._prefix = f"{MARK} {self.token} "
        self._lock = threading.Condition()
        self._control_read, self._control_write = os.pipe()
        #: The supervisor's pid once it said it is ready.
        self.supervisor: int | None = None
        #: Why this process is no fork server ('' while it may be one or is): its threads, a failure.
        self.refused = ""
        self.child: Child | None = None
        #: Children forked so far (the first included).
        self.forks = 0

    # ---- the spawn --------------------------------------------------------------------------------------------

    def environment(self, preload: Path) -> dict[str, str]:
        """The variables the server is started with (the library first in ``LD_PRELOAD``, the user's after)."""
        preloads = [str(preload), *os.environ.get("LD_PRELOAD", "").split()]
        return {"LD_PRELOAD": " ".join(p for p in preloads if p), ENV: f"{self.token}:{self._control_read}"}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self._control_read,)

    def spawned(self) -> None:
        """The server has been started: the kit's copy of the pipe's read end is the server's alone now."""
        with contextlib.suppress(OSError):
            os.close(self._control_read)

    def close(self) -> None:
        """The server is gone: a supervisor still waiting for the kit's word reads the end of the pipe and exits."""
        with contextlib.suppress(OSError):
            os.close(self._control_write)
        self.spawned()

    # ---- lines ------------------------------------------------------------------------------------------------

    def feed(self, line: str, sanitizer_count: int) -> str | None:
        """One line of the server's output (``sanitizer_count``: the target's sanitizer reports so far): the
        supervisor's lines are taken (None, or the server's text before the mark when it shares the line); any
        other line is returned, after joining the current child's log."""
        at = line.find(self._prefix)
        if at < 0:
            with self._lock:
                if self.child is not None and self.child.code is None:
                    self.child.log.append(line)
            return line
        words = line[at + len(self._prefix):].split()
        with self._lock:
            self._event(words, sanitizer_count)
            self._lock.notify_all()
        rest = line[:at]
        return rest if rest.strip() else None

    def _event(self, words: list[str], sanitizer_count: int) -> None:
        try:
            match words:
                case ["ready", pid]:
                    self.supervisor = int(pid)
                case ["threads", n]:
                    self.refused = (f"the server has {n} threads when it first accepts a connection (a fork copies "
                                    "only one)")
                case ["child", n, pid]:
                    self.child = Child(int(n), int(pid), sanitizer_mark=sanitizer_count)
                    self.forks += 1
                case ["end", n, pid, status]:
                    if self.child is not None and self.child.number == int(n):
                        self.child.code = wait_status(int(status))
                    else:
                        self.child = Child(int(n), int(pid), code=wait_status(int(status)))
                case ["failed", what, errno]:
                    self.refused = f"the fork server failed ({what}: {os.strerror(int(errno))})"
        except ValueError:
            pass  # not a line of the supervisor's (the token makes that unlikely): ignored

    # ---- the kit's questions ----------------------------------------------------------------------------------

    @property
    def decided(self) -> bool:
        """Has the process said whether it is a fork server?"""
        with self._lock:
            return self.supervisor is not None or bool(self.refused)

    @property
    def active(self) -> bool:
        """Is the process a working fork server?"""
        with self._lock:
            return self.supervisor is not None and not self.refused

    @property
    def child_ended(self) -> bool:
        """Has the current child ended (and not been replaced yet)?"""
        with self._lock:
            return self.child is not None and self.child.code is not None

    @property
    def child_running(self) -> bool:
        """Has a child started that has not ended?"""
        with self._lock:
            return self.child is not None and self.child.code is None

    def wait(self, condition: str, timeout: float, pump: Callable[[], None]) -> bool:
        """Wait (bounded) until ``condition`` (an attribute of this object) holds, reading output with ``pump``
        (the target's: it reads what the server has written so far) between waits."""
        deadline = time.monotonic() + timeout
        while True:
            pump()
            if getattr(self, condition):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._lock:
                self._lock.wait(min(left, 0.02))

    def kill_child(self) -> None:
        """Kill the current child (a hung one): the supervisor reports its end and waits for the kit's word."""
        with self._lock:
            child = self.child
            if child is None or child.code is not None:
                return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child.pid, signal.SIGKILL)

    def fork_again(self) -> None:
        """Tell the waiting supervisor to listen again and fork a fresh child."""
        with self._lock:
            self.child = None
        try:
            os.write(self._control_write, b"r")
        except OSError as exc:
            raise ForkServerUnavailable(f"the fork server does not listen to the kit any more: {exc}") from None


__all__ = ["ENV", "MARK", "Child", "ForkServer", "ForkServerUnavailable", "library", "wait_status"]
