"""A server the harness starts from a command line: its output read, its deaths reported, restarted after each.

The restart is a new process, or, with the kit's fork server (:mod:`.forkserver`), a fork of the first one as it
first accepted a connection.
"""

from __future__ import annotations

import contextlib
import os
import platform
import select
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .forkserver import ForkServer, ForkServerUnavailable, library
from .sanitizer_log import SanitizerLog, SanitizerReport
from .targets import Target, TargetError, exit_status, free_port, wait_for_port

#: Calls that read a descriptor, by machine (Linux's numbers): read, readv, recvfrom, recvmsg, recvmmsg.
_READ_CALLS = {"x86_64": {0, 19, 45, 47, 299}, "aarch64": {63, 65, 207, 212, 243}}.get(platform.machine(), set())
#: Seconds a server that stopped answering gets to end before it counts as hung: a dying process (a core dump, exit
#: handlers) takes a moment, several on a loaded machine, and a death reported as a hang is judged another finding.
DEATH_WAIT = 10.0
#: Seconds between the two looks of :func:`waiting_for_input` (a running process accrues CPU ticks meanwhile).
IDLE_SAMPLE = 0.05


def _reading_a_socket(pid: int) -> tuple[bool, int] | None:
    """(is the process's main thread blocked in a read call on a socket, its CPU ticks so far), from /proc; None when
    that cannot be read (not Linux, no permission, gone)."""
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime, every thread's
        if not call or call[0] == "running" or int(call[0]) not in _READ_CALLS:
            return False, ticks
        return os.readlink(f"/proc/{pid}/fd/{int(call[1], 16)}").startswith("socket:"), ticks
    except (OSError, ValueError, IndexError):
        return None


def waiting_for_input(pid: int) -> bool | None:
    """Is process ``pid`` blocked reading a socket and using no CPU, twice :data:`IDLE_SAMPLE` apart (a server
    that waits for a client's next bytes: it will neither answer nor close before they come)?  None: unknown."""
    first = _reading_a_socket(pid)
    if first is None or not first[0]:
        return None if first is None else False
    time.sleep(IDLE_SAMPLE)
    second = _reading_a_socket(pid)
    if second is None:
        return None
    return second[0] and second[1] == first[1]


class ProcessOutput:
    """A spawned process's output pipe (stdout and stderr together), read line by line by a thread of its own and,
    on demand, by the kit (:meth:`pump`): after ``pump()`` every line the process wrote before it was called has
    been handed to ``on_line`` (a reply the kit has read was written after the lines that precede it, so nothing the
    server said before its reply is missed, however late the thread runs)."""

    #: A line longer than this is handed over in pieces (a server printing without newlines stays bounded).
    MAX_LINE = 64 * 1024

    def __init__(self, stream: IO[bytes], on_line: Callable[[str], None]) -> None:
        self._stream = stream
        self._fd = stream.fileno()
        os.set_blocking(self._fd, False)
        self._on_line = on_line
        self._lock = threading.Lock()
        self._partial = b""
        #: The pipe is at its end (the process and everything that held its output is gone) or was closed.
        self.ended = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="ggml-rpc-server-output")
        self._thread.start()

    def _run(self) -> None:
        while not self.ended:
            try:
                # A timeout, so that a closed pipe (stop()) ends this thread even if nothing is written any more.
                select.select([self._fd], [], [], 0.5)
            except (OSError, ValueError):
                return
            self.pump()

    def pump(self) -> None:
        """Read and hand over every complete line written so far (and the rest at the pipe's end)."""
        with self._lock:
            while not self.ended:
                try:
                    chunk = os.read(self._fd, 65536)
                except BlockingIOError:
                    return
                except OSError:
                    chunk = b""
                if not chunk:
                    if self._partial:
                        self._hand(self._partial)
                    self._partial = b""
                    self.ended = True
                    return
                *lines, self._partial = (self._partial + chunk).split(b"\n")
                for raw in lines:
                    self._hand(raw)
                while len(self._partial) > self.MAX_LINE:
                    self._hand(self._partial[:self.MAX_LINE])
                    self._partial = self._partial[self.MAX_LINE:]

    def _hand(self, raw: bytes) -> None:
        self._on_line(raw.decode("utf-8", "replace").rstrip())

    def close(self, wait: float = 1.0) -> None:
        """Read what is left (the process has ended: up to the pipe's end, bounded by ``wait``), then close."""
        self._thread.join(timeout=wait)
        with self._lock:
            self.ended = True
            self._stream.close()


class SpawnedTarget(Target):
    """A server the harness starts itself from a command line (``{port}`` is replaced by a free port).

    Its output is kept (last lines) so that a death can be reported with its exit status and log tail.

    With ``fork_server``, the kit's fork server (:mod:`.forkserver`) is preloaded: the server process is started
    once, and each restart after a death is a fork of it as it was when it first accepted a connection. A death is
    reported as a process's would be (the child's exit status, its own log and sanitizer reports); connections are
    refused between a death and the restart, as by a dead process. A server that cannot be one (other threads when
    it first accepts, no C compiler, a program that does not call ``accept()`` through the preload) runs as a plain
    process; :attr:`fork_note` says why.
    """

    can_restart = True

    def __init__(
        self, command: str, *, host: str = "127.0.0.1", cache_dir: Path | None = None, startup_timeout: float = 20.0,
        fork_server: bool = False, env: dict[str, str] | None = None,
    ) -> None:
        self.command = command
        self.host = host
        self._cache_dir = cache_dir
        self.startup_timeout = startup_timeout
        #: Variables set for the server on top of the kit's own environment.
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: deque[str] = deque(maxlen=20)
        #: Sanitizer reports of every process started so far (an instrumented build prints them on stderr).
        self.sanitizer = SanitizerLog()
        #: :attr:`sanitizer`'s count when the current process started: its own reports come after.
        self._process_mark = 0
        self._output: ProcessOutput | None = None
        self.description = f"spawned: {command}"
        self.restarts = 0
        #: Use the fork server when the server allows it (asked for, and not found impossible yet).
        self.fork_server = fork_server
        #: Why the fork server is not used ('' when it is, or was not asked for).
        self.fork_note = ""
        #: Restarts that were forks (of :attr:`restarts`).
        self.fork_restarts = 0
        self._fork: ForkServer | None = None

    @property
    def cache_dir(self) -> Path | None:
        return self._cache_dir

    @property
    def forking(self) -> bool:
        """Is the running server a working fork server?"""
        return self._fork is not None and self._fork.active

    @property
    def restart_mode(self) -> str:
        """How the server comes back after a death, for a report's header."""
        if self.forking:
            return "restarts: forks of the server as it first accepted a connection (the kit's fork server)"
        why = f" (no fork server: {self.fork_note})" if self.fork_note else ""
        return f"restarts: a new server process each{why}"

    @property
    def pid(self) -> int | None:
        """The process serving connections: the fork server's current child, or the process."""
        if self.forking:
            assert self._fork is not None
            child = self._fork.child
            if child is not None and child.code is None:
                return child.pid
        return self.proc.pid if self.proc is not None else None

    def _argv(self) -> list[str]:
        if "{port}" in self.command:
            self.port = free_port(self.host)
            return shlex.split(self.command.replace("{port}", str(self.port)))
        if not self.port:
            raise TargetError("--spawn needs --server HOST:PORT or a {port} placeholder in CMD")
        return shlex.split(self.command)

    def _new_fork_server(self) -> ForkServer | None:
        if not self.fork_server:
            return None
        try:
            library()
        except (ForkServerUnavailable, OSError, subprocess.SubprocessError) as exc:
            self.fork_server, self.fork_note = False, str(exc)
            return None
        return ForkServer()

    def start(self) -> None:
        argv = self._argv()
        self.log.clear()
        self._process_mark = self.sanitizer.count
        fork = self._new_fork_server()
        env = {**os.environ, **self.env, **(fork.environment(library()) if fork is not None else {})}
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, env=env, pass_fds=fork.pass_fds if fork is not None else (),
            )
        except OSError as exc:
            if fork is not None:
                fork.close()
            raise TargetError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        self._fork = fork
        if fork is not None:
            fork.spawned()
        assert self.proc.stdout is not None
        self._output = ProcessOutput(self.proc.stdout, self._line)
        started = time.monotonic()
        if not wait_for_port(self.host, self.port, self.startup_timeout, lambda: self.proc.poll() is None):
            info = self.death_info() or {}
            self.stop()
            tail = " | ".join(info.get("log_tail", [])[-3:])
            status = f"{info.get('status', 'timeout')}" + (f" ({tail})" if tail else "")
            if fork is not None and self.proc.poll() is not None:
                # A program that cannot start with the preload (an ASan build wants its runtime first in the
                # library list) is started again without it.
                self.fork_server, self.fork_note = False, f"the server did not start with it: {status}"
                self.start()
                return
            raise TargetError(f"spawned server did not listen on {self.address}: {status}")
        if fork is not None:
            self._settle_fork_server(fork, self.startup_timeout - (time.monotonic() - started))

    def _settle_fork_server(self, fork: ForkServer, wait: float) -> None:
        """Wait for the server's first accept(), where the fork server says whether it serves; run the server as a
        plain process when it cannot."""
        if fork.wait("decided", max(wait, 1.0), self.pump):
            if fork.active:
                return
            self.fork_note = fork.refused
            self._fork = None
            fork.close()
            self.fork_server = False  # the next start is plain: no preload
            return
        # It listens but never called accept() through the preload (a static program, another call): started again
        # without it, so that it cannot turn into a fork server halfway through a run.
        self.fork_note = "the server did not accept a connection through the fork server's preload"
        self.fork_server = False
        self.stop()
        self.start()

    def _line(self, line: str) -> None:
        fork = self._fork
        if fork is not None:
            text = fork.feed(line, self.sanitizer.count)
            if text is None:
                return
            line = text
        self.log.append(line)
        self.sanitizer.feed(line)

    def pump(self) -> None:
        """Read every line the server has written so far (see :class:`ProcessOutput`)."""
        if self._output is not None:
            self._output.pump()

    @property
    def sanitizer_count(self) -> int:
        return self.sanitizer.count

    def sanitizer_reports(self, since: int) -> list[SanitizerReport]:
        self.pump()
        return self.sanitizer.since(since)

    def death_info(self) -> dict[str, Any] | None:
        if self.proc is None:
            return None
        fork = self._fork
        if fork is not None and fork.active and self.proc.poll() is None:
            return self._child_death_info(fork)
        try:
            code = self.proc.wait(timeout=DEATH_WAIT)
        except subprocess.TimeoutExpired:
            return {"status": "still running but not answering", "log_tail": list(self.log)}
        if self._output is not None:
            self._output.close()
        info: dict[str, Any] = {"status": exit_status(code), "exit_code": code, "log_tail": list(self.log)}
        self._name_fatal_report(info, self._process_mark)
        return info

    def _child_death_info(self, fork: ForkServer) -> dict[str, Any]:
        """A fork server's child's end, as :meth:`death_info` reports a process's."""
        # Then the supervisor reports it.
        ended = fork.wait("child_ended", DEATH_WAIT, self.pump)
        child = fork.child
        if not ended or child is None or child.code is None:
            return {"status": "still running but not answering", "log_tail": list(child.log if child else self.log)}
        info: dict[str, Any] = {"status": exit_status(child.code), "exit_code": child.code, "log_tail": list(child.log)}
        self._name_fatal_report(info, child.sanitizer_mark)
        return info

    def _name_fatal_report(self, info: dict[str, Any], mark: int) -> None:
        # Only a fatal report (ASan) explains a death; UBSan's recover and are findings of their own.
        fatal = [r for r in self.sanitizer.since(mark) if r.fatal]
        if fatal:
            # The process's last fatal report is what killed it; the status names it rather than "exit code 1".
            info["sanitizer"] = fatal[-1].to_dict()
            info["status"] = f"{info['status']} after {fatal[-1].headline()}"

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        if self._output is not None:
            self._output.close()
        if self._fork is not None:
            self._fork.close()

    def restart(self) -> None:
        if self.forking and self.proc is not None and self.proc.poll() is None:
            try:
                self._fork_again()
                self.restarts += 1
                self.fork_restarts += 1
                return
            except ForkServerUnavailable as exc:
                self.fork_note = str(exc)  # started anew below, as a fork server again
        self.stop()
        self.restarts += 1
        self.start()

    def _fork_again(self) -> None:
        """A fresh child of the fork server (the current one killed first if it still runs, e.g. hung)."""
        fork = self._fork
        assert fork is not None
        if not fork.child_ended:
            fork.kill_child()
            if not fork.wait("child_ended", 5.0, self.pump):
                raise ForkServerUnavailable("the fork server did not report its child's end")
        fork.fork_again()
        if not fork.wait("child_running", self.startup_timeout, self.pump):
            raise ForkServerUnavailable("the fork server did not fork a new child")

    def waiting_for_input(self) -> bool | None:
        pid = self.pid
        return waiting_for_input(pid) if pid is not None else None

    def process_exited(self) -> bool:
        if self.proc is None:
            return False
        if self.forking:
            assert self._fork is not None
            self.pump()
            return self.proc.poll() is not None or self._fork.child_ended
        return self.proc.poll() is not None

    @property
    def startup_wait(self) -> float:  # type: ignore[override]
        return self.startup_timeout
