"""Targets: where the server under test is and how to bring it back.

An :class:`ExternalTarget` is a server someone else runs; a :class:`SpawnedTarget` is started by the harness from a
command line, its log tail kept, and restarted after it dies; an :class:`EmbeddedTarget` is the kit's reference
server in this process.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ggml_rpc.reference import running_server
from ggml_rpc.reference.config import CodebookSource
from ggml_rpc.spec import Protocol

from .sanitizer_log import SanitizerLog, SanitizerReport


class TargetError(Exception):
    """The server could not be started or reached (a usage problem for the CLI: one line, exit code 2)."""


def parse_address(text: str, *, any_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0 only with ``any_port``) to a tuple; ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if any_port else 1) <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    """``HOST:PORT`` as :func:`parse_address` reads it back (``[::1]:PORT`` for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def wait_for_port(host: str, port: int, timeout: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll until a TCP connect succeeds (True) or the time runs out / ``alive`` says the process is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class Target:
    """A server under test: an address, and maybe a way to restart it."""

    host: str = "127.0.0.1"
    port: int = 0
    description: str = ""
    can_restart = False

    def start(self) -> None:
        """Bring the server up (no-op for an external one)."""

    def stop(self) -> None:
        """Shut down what :meth:`start` brought up."""

    def death_info(self) -> dict[str, Any] | None:
        """Exit status and last log lines of a dead spawned server; None when unknown."""
        return None

    def restart(self) -> None:
        raise TargetError("this server cannot be restarted by the harness")

    @property
    def sanitizer_count(self) -> int:
        """How many sanitizer reports the server has printed so far (0 when its output is not read)."""
        return 0

    def sanitizer_reports(self, since: int) -> list[SanitizerReport]:
        """The reports printed after the first ``since`` (a previous :attr:`sanitizer_count`), once the output
        written so far has been read."""
        return []

    def process_exited(self) -> bool:
        """True when the harness knows the server's process has ended (only a spawned server is known)."""
        return False

    #: How long a step waits for a (re)starting server to accept before judging it gone.
    startup_wait = 0.0

    @property
    def cache_dir(self) -> Path | None:
        """The server's cache directory when the harness knows it (white-box checks)."""
        return None

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


class ExternalTarget(Target):
    """A server someone else runs at HOST:PORT."""

    def __init__(self, host: str, port: int, cache_dir: Path | None = None) -> None:
        self.host, self.port = host, port
        self._cache_dir = cache_dir
        self.description = f"server at {self.address}"

    @property
    def cache_dir(self) -> Path | None:
        return self._cache_dir


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that was free a moment ago (for servers started by a command line)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_status(code: int) -> str:
    """How a server process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class SpawnedTarget(Target):
    """A server the harness starts itself from a command line (``{port}`` is replaced by a free port).

    Its output is kept (last lines) so that a death can be reported with its exit status and log tail.
    """

    can_restart = True

    def __init__(
        self, command: str, *, host: str = "127.0.0.1", cache_dir: Path | None = None, startup_timeout: float = 20.0
    ) -> None:
        self.command = command
        self.host = host
        self._cache_dir = cache_dir
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: deque[str] = deque(maxlen=20)
        #: Sanitizer reports of every process started so far (an instrumented build prints them on stderr).
        self.sanitizer = SanitizerLog()
        #: :attr:`sanitizer`'s count when the current process started: its own reports come after.
        self._process_mark = 0
        self._reader: threading.Thread | None = None
        self.description = f"spawned: {command}"
        self.restarts = 0

    @property
    def cache_dir(self) -> Path | None:
        return self._cache_dir

    def _argv(self) -> list[str]:
        if "{port}" in self.command:
            self.port = free_port(self.host)
            return shlex.split(self.command.replace("{port}", str(self.port)))
        if not self.port:
            raise TargetError("--spawn needs --server HOST:PORT or a {port} placeholder in CMD")
        return shlex.split(self.command)

    def start(self) -> None:
        argv = self._argv()
        self.log.clear()
        self._process_mark = self.sanitizer.count
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            raise TargetError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        self._reader = threading.Thread(target=self._read_log, args=(self.proc,), daemon=True)
        self._reader.start()
        if not wait_for_port(self.host, self.port, self.startup_timeout, lambda: self.proc.poll() is None):
            info = self.death_info() or {}
            self.stop()
            tail = " | ".join(info.get("log_tail", [])[-3:])
            raise TargetError(f"spawned server did not listen on {self.address}: {info.get('status', 'timeout')}"
                              + (f" ({tail})" if tail else ""))

    def _read_log(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                self.log.append(line)
                self.sanitizer.feed(line)
        except (ValueError, OSError):
            pass  # stop() closed the pipe under this thread: the process is gone, nothing more to read

    @property
    def sanitizer_count(self) -> int:
        return self.sanitizer.count

    def sanitizer_reports(self, since: int) -> list[SanitizerReport]:
        self._settle_output()
        return self.sanitizer.since(since)

    def _settle_output(self, limit: float = 0.2) -> None:
        """Wait (briefly) until the output the server has written is read: a UBSan report is written before the
        reply it precedes, but the reader thread may not have taken it from the pipe yet."""
        proc = self.proc
        if proc is None or proc.stdout is None or proc.stdout.closed:
            return
        import fcntl
        import struct
        import termios

        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                pending = struct.unpack("i", fcntl.ioctl(proc.stdout.fileno(), termios.FIONREAD, b"\0" * 4))[0]
            except (OSError, ValueError):
                return
            if pending == 0:
                time.sleep(0.005)  # the reader's last line, taken but not yet parsed
                return
            time.sleep(0.005)

    def death_info(self) -> dict[str, Any] | None:
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout=3.0)  # a dying process (core dump, exit handlers) takes a moment
        except subprocess.TimeoutExpired:
            return {"status": "still running but not answering", "log_tail": list(self.log)}
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        info: dict[str, Any] = {"status": exit_status(code), "exit_code": code, "log_tail": list(self.log)}
        # Only a fatal report (ASan) explains a death; UBSan's recover and are findings of their own.
        fatal = [r for r in self.sanitizer.since(self._process_mark) if r.fatal]
        if fatal:
            # The process's last fatal report is what killed it; the status names it rather than "exit code 1".
            info["sanitizer"] = fatal[-1].to_dict()
            info["status"] = f"{info['status']} after {fatal[-1].headline()}"
        return info

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
        if proc.stdout is not None:
            proc.stdout.close()

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def process_exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def startup_wait(self) -> float:  # type: ignore[override]
        return self.startup_timeout


class EmbeddedTarget(Target):
    """The kit's own reference server, in this process, on an ephemeral loopback port.

    Protocol 7 gets a temporary cache directory (so the cache rules are observable); 6 gets one too, since the
    v6 rule is only observable with a cache.  ``codebooks``: where its executor reads the IQ codebooks (the reference
    holds no upstream data; ``ggml-rpc check`` passes those of an installed upstream peer).
    """

    def __init__(self, protocol: Protocol, cache_dir: Path | None = None, *,
                 codebooks: CodebookSource | None = None) -> None:
        self.protocol = protocol
        self._given_cache = cache_dir
        self._codebooks = codebooks
        self._cache_dir: Path | None = cache_dir
        self._stack: contextlib.ExitStack | None = None
        self.description = f"embedded reference server, protocol {protocol.label}"

    @property
    def cache_dir(self) -> Path | None:
        return self._cache_dir

    def start(self) -> None:
        stack = contextlib.ExitStack()
        if self._given_cache is None:
            self._cache_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ggml-rpc-cache-")))
        cache = str(self._cache_dir) if self._cache_dir else None
        server = stack.enter_context(running_server(self.protocol, cache_dir=cache, codebooks=self._codebooks))
        self.host, self.port = server.host, server.port
        self._stack = stack

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
