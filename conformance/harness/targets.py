"""Targets: where the server under test is and how to bring it back.

An :class:`ExternalTarget` is a server someone else runs; an :class:`EmbeddedTarget` is the kit's reference server in
this process; a :class:`~.spawned.SpawnedTarget` (in :mod:`.spawned`) is started by the harness from a command line,
its log tail kept, and restarted after it dies.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ggml_rpc.reference import running_server
from ggml_rpc.reference.config import CodebookSource
from ggml_rpc.spec import Protocol

from .sanitizer_log import SanitizerReport


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

    def waiting_for_input(self) -> bool | None:
        """Is the server blocked reading its connection, using no CPU (so it sends nothing more until it gets more
        input)?  None when the harness cannot tell (only a process on this machine can be looked at)."""
        return None

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
