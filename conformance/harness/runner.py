"""The conformance harness: checks as data, their results, and the runner that drives a live server.

A :class:`Check` is a declaration (ID, title, spec anchor, versions, level, category) plus a function taking a
:class:`Context`.  The function returns normally for a pass (optionally with a note) or raises
:class:`CheckFailed` (with evidence: what was sent, what was expected, what came back), :class:`Skipped` (why the
check cannot judge this server) or :class:`Unsupported` (the server declines a feature the check needs).

The :class:`Runner` learns the server's version from HELLO before anything version-dependent is sent, runs each
selected check on fresh connections, and after every check makes sure the server still accepts a connection.  A
server that dies during a check is that check's SHOULD failure (never a MUST one, never a "connection refused"),
naming the exit status, the step and the bytes sent.  A spawned server is then restarted and waited for until it
answers HELLO, so the next check never races its start; a death found before a check started is reported as
unexplained instead of blamed on it.  An external server that died, or a failed restart, ends the run: the
remaining checks are "not run".
"""

from __future__ import annotations

import contextlib
import enum
import fnmatch
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_rpc.spec import PROTOCOLS, V6, Command, HandshakeError, Protocol, ProtocolError, protocol_for
from ggml_rpc.spec.docs import command_anchor

from ..client import ConnectionClosed, RpcClient

#: Where the generated protocol reference lives, relative to a checkout; check links point into it.
SPEC_DOC = "spec/PROTOCOL.md"


class Level(enum.Enum):
    """How binding a rule is: a MUST failure fails the run, a SHOULD failure only with ``--strict``."""

    MUST = "MUST"
    SHOULD = "SHOULD"


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    UNSUPPORTED = "unsupported"
    NOT_RUN = "not run"
    #: The check itself broke (a bug in the kit, not a finding about the server): counts as a failure.
    ERROR = "error"


class Category(enum.Enum):
    """Check groups, in the order a run goes through them."""

    HANDSHAKE = "handshake"
    FRAMING = "framing"
    DATA = "data"
    CACHE_V6 = "cache-v6"
    CACHE_V7 = "cache-v7"
    ISOLATION = "isolation"
    COMPUTE = "compute"


@dataclass(frozen=True, slots=True)
class Evidence:
    """One observation behind a verdict.  Byte values are given as hex where bytes matter."""

    step: str
    sent: str | None = None
    expected: str | None = None
    got: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"step": self.step, "sent": self.sent, "expected": self.expected, "got": self.got}


class CheckFailed(Exception):
    """The server broke the rule.  ``level`` overrides the check's level (a SHOULD part of a MUST check)."""

    def __init__(
        self,
        message: str,
        *,
        sent: str | None = None,
        expected: str | None = None,
        got: str | None = None,
        level: Level | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.evidence = Evidence(message, sent, expected, got)
        self.level = level


class ServerGone(CheckFailed):
    """A step found no server to talk to: the server died earlier in this check (the death is the finding)."""


class Skipped(Exception):
    """The check cannot judge this server (for example: no hash cache to observe)."""


class Unsupported(Exception):
    """The server declines something the check needs (an op, a command of another version)."""


def hexdump(data: bytes | bytearray | memoryview, limit: int = 64) -> str:
    """Bytes as spaced hex, cut after ``limit`` bytes (with the total length)."""
    raw = bytes(data)
    text = raw[:limit].hex(" ")
    if len(raw) > limit:
        text += f" … ({len(raw)} bytes)"
    return text if raw else "(no bytes)"


@dataclass(frozen=True, slots=True)
class Check:
    """One conformance rule, as data."""

    id: str
    title: str
    category: Category
    level: Level
    #: Protocol majors the rule applies to (e.g. ``(6, 7)``); ``(7,)`` for v7-only rules.
    majors: tuple[int, ...]
    #: What it enforces: a command (linked per version, ``v7-get_tensor``) or a fixed anchor (``framing``).
    section: Command | str
    func: Callable[[Context], str | None]
    #: Minimum (major, minor, patch) within the majors, for rules added by a patch release.
    min_version: tuple[int, int, int] | None = None
    #: Maximum version (inclusive) the rule applies to, for rules a later patch changed.
    max_version: tuple[int, int, int] | None = None
    #: Runs even when the server's version is not covered (handshake rules).
    any_version: bool = False

    def applies_to(self, version: tuple[int, int, int]) -> bool:
        if version[0] not in self.majors:
            return False
        if self.min_version is not None and version < self.min_version:
            return False
        return self.max_version is None or version <= self.max_version

    def spec_link(self, protocol: Protocol | None) -> str:
        """``spec/PROTOCOL.md#<anchor>`` for the version the server speaks (its newest applicable otherwise)."""
        if isinstance(self.section, str):
            return f"{SPEC_DOC}#{self.section}"
        candidates = [p for p in PROTOCOLS if self.applies_to(p.version) and p.spec(self.section) is not None]
        chosen = protocol if protocol is not None and protocol in candidates else (candidates or [None])[-1]
        if chosen is None:
            return f"{SPEC_DOC}#enum-commands"
        return f"{SPEC_DOC}#{command_anchor(chosen, self.section)}"

    @property
    def versions_label(self) -> str:
        text = "/".join(str(m) for m in self.majors)
        if self.min_version:
            text = ">=" + ".".join(map(str, self.min_version))
        if self.max_version:
            text += " <=" + ".".join(map(str, self.max_version))
        return "any" if self.any_version else text


@dataclass(slots=True)
class Result:
    check: Check
    outcome: Outcome
    message: str = ""
    evidence: list[Evidence] = field(default_factory=list)
    #: For FAIL/ERROR: the level of the broken rule (MUST, or SHOULD for a check's SHOULD part).
    failed_level: Level | None = None
    duration: float = 0.0
    #: When the server died during this check: exit status and last log lines (spawned servers) or a note,
    #: plus the step during which it died and the bytes that step sent (``step``, ``sent``; None if unknown).
    server_death: dict[str, Any] | None = None
    spec: str = ""
    #: The failure came from the connection breaking (closed, reset, refused, timed out), not from a wrong answer:
    #: when the server turns out to have died, the death is the verdict.
    interrupted: bool = False

    @property
    def failed(self) -> bool:
        return self.outcome in (Outcome.FAIL, Outcome.ERROR)

    def as_dict(self) -> dict[str, Any]:
        c = self.check
        return {
            "id": c.id,
            "title": c.title,
            "category": c.category.value,
            "level": c.level.value,
            "versions": c.versions_label,
            "spec": self.spec,
            "outcome": self.outcome.value,
            "failed_level": self.failed_level.value if self.failed_level else None,
            "message": self.message,
            "duration_s": round(self.duration, 4),
            "evidence": [e.as_dict() for e in self.evidence],
            "server_death": self.server_death,
        }


# ---- targets: where the server under test is and how to bring it back --------------------------------------------


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
        for line in proc.stdout:
            self.log.append(line.decode("utf-8", "replace").rstrip())

    def death_info(self) -> dict[str, Any] | None:
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout=3.0)  # a dying process (core dump, exit handlers) takes a moment
        except subprocess.TimeoutExpired:
            return {"status": "still running but not answering", "log_tail": list(self.log)}
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        return {"status": exit_status(code), "exit_code": code, "log_tail": list(self.log)}

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
    v6 rule is only observable with a cache.
    """

    def __init__(self, protocol: Protocol, cache_dir: Path | None = None) -> None:
        self.protocol = protocol
        self._given_cache = cache_dir
        self._cache_dir: Path | None = cache_dir
        self._stack: contextlib.ExitStack | None = None
        self.description = f"embedded reference server, protocol {protocol.label}"

    @property
    def cache_dir(self) -> Path | None:
        return self._cache_dir

    def start(self) -> None:
        from ggml_rpc.reference import running_server

        stack = contextlib.ExitStack()
        if self._given_cache is None:
            self._cache_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ggml-rpc-cache-")))
        cache = str(self._cache_dir) if self._cache_dir else None
        server = stack.enter_context(running_server(self.protocol, cache_dir=cache))
        self.host, self.port = server.host, server.port
        self._stack = stack

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


# ---- the run ------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ServerInfo:
    """What the handshake and the first questions taught about the server."""

    version: tuple[int, int, int] | None = None
    protocol: Protocol | None = None
    hello_raw: bytes = b""
    device_count: int = 0
    #: "speaks 7.0", "speaks 7.0.1", "8.x not covered"…
    verdict: str = ""
    #: Cache observed: True / False; None until a check asked.
    cache: bool | None = None
    cache_note: str = ""

    @property
    def covered(self) -> bool:
        return self.protocol is not None

    @property
    def version_label(self) -> str:
        return ".".join(map(str, self.version)) if self.version else "?"


def verdict_for(version: tuple[int, int, int]) -> tuple[Protocol | None, str]:
    """The table a server of this version speaks and the one-line verdict ("speaks 7.0", "speaks 8.x: not covered
    by this kit")."""
    protocol = protocol_for(*version)
    if protocol is None:
        if version[0] in {p.major for p in PROTOCOLS}:
            return None, f"speaks {'.'.join(map(str, version))}: not covered by this kit"
        return None, f"speaks {version[0]}.x: not covered by this kit"
    label = f"{version[0]}.{version[1]}" if protocol.version[2] == 0 else protocol.label
    return protocol, f"speaks {label}"


class Context:
    """What a check function gets: the server's address and version, fresh connections, shared facts."""

    def __init__(self, runner: Runner, check: Check) -> None:
        self.runner = runner
        self.check = check
        self.evidence: list[Evidence] = []
        self._clients: list[RpcClient] = []
        #: Connections this check opened; none when its first connect already found no server.
        self.connections = 0
        #: The check's very first connect found no server: it died before the check, of something else.
        self.gone_before_start = False

    @property
    def info(self) -> ServerInfo:
        return self.runner.info

    @property
    def protocol(self) -> Protocol:
        assert self.runner.info.protocol is not None
        return self.runner.info.protocol

    @property
    def version(self) -> tuple[int, int, int]:
        assert self.runner.info.version is not None
        return self.runner.info.version

    @property
    def timeout(self) -> float:
        return self.runner.timeout

    @property
    def cache_dir(self) -> Path | None:
        return self.runner.target.cache_dir

    @property
    def target(self) -> Target:
        return self.runner.target

    def note(self, step: str, *, sent: str | None = None, expected: str | None = None, got: str | None = None) -> None:
        """Record an observation (kept as evidence of the verdict)."""
        self.evidence.append(Evidence(step, sent, expected, got))

    def connect(
        self, *, hello: bool = True, protocol: Protocol | None = None, timeout: float | None = None
    ) -> RpcClient:
        """A new connection (closed when the check ends), HELLO done, encoding the server's version.

        Raises :class:`ServerGone` when a spawned server's process has exited (its death is the verdict, not a
        refused connect), after waiting (bounded) for a live one that does not accept yet.
        """
        target = self.runner.target
        # One deadline for all retries: a server flapping between accepting and refusing cannot loop forever.
        deadline = time.monotonic() + target.startup_wait
        while True:
            try:
                client = RpcClient.connect(
                    target.host,
                    target.port,
                    timeout=timeout or self.timeout,
                    protocol=protocol or self.runner.info.protocol or V6,  # HELLO is the same everywhere
                    hello=hello,
                )
                break
            except ConnectionRefusedError as exc:
                if not target.process_exited() and target.can_restart:
                    # A restarted server may still be binding its port: wait for it (bounded) instead of
                    # judging it, then try again.
                    left = deadline - time.monotonic()
                    if left > 0 and wait_for_port(target.host, target.port, left,
                                                  lambda: not target.process_exited()):
                        continue
                raise self._gone(exc, refused=True) from exc
            except OSError as exc:
                # A timeout or reset from a process that has exited was its death, not this connect's verdict;
                # from a live server it stays a failure (ISO-003 reads a HELLO timeout from the cause).
                if target.process_exited():
                    raise self._gone(exc) from exc
                raise CheckFailed(f"cannot connect to {target.address}: {exc}") from exc
        self._clients.append(client)
        self.connections += 1
        return client

    def _gone(self, exc: OSError, *, refused: bool = False) -> ServerGone:
        """The :class:`ServerGone` for a connect that found no server (noting whether nothing was sent yet)."""
        target = self.runner.target
        if refused and self.connections == 0:
            # Not one byte of this check reached the server: whatever killed it came before.
            self.gone_before_start = True
        why = "the server process has exited" if target.process_exited() else str(exc)
        return ServerGone(f"cannot connect to {target.address}: {why}")

    def close_all(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()

    def shared(self, key: str, compute: Callable[[], Any]) -> Any:
        """A fact computed once per run (per server start) and shared between checks."""
        cache = self.runner.shared
        if key not in cache:
            cache[key] = compute()
        return cache[key]


ProgressFn = Callable[[Result], None]


class Runner:
    """Runs checks against one target, one at a time, in catalogue order."""

    def __init__(
        self,
        target: Target,
        *,
        expect: Protocol | None = None,
        timeout: float = 5.0,
        probe_timeout: float = 5.0,
    ) -> None:
        self.target = target
        self.expect = expect
        self.timeout = timeout
        self.probe_timeout = probe_timeout
        self.info = ServerInfo()
        self.shared: dict[str, Any] = {}
        self.dead_after: str | None = None
        #: Why the remaining checks are not run (set with ``dead_after``).
        self.stop_reason: str | None = None
        #: Deaths no check explains (found before a check started): status, log tail, "after" and "before".
        self.unexplained_deaths: list[dict[str, Any]] = []
        self.results: list[Result] = []
        self._last_run: str | None = None
        self.started_at = 0.0
        self.finished_at = 0.0
        self._started = False

    # -- lifecycle --

    def start(self) -> ServerInfo:
        """Start the target and learn its version from HELLO (raises TargetError when unreachable)."""
        self.started_at = time.time()
        self.target.start()
        self._started = True
        self.handshake()
        return self.info

    def handshake(self) -> None:
        try:
            client = RpcClient.connect(self.target.host, self.target.port, timeout=self.probe_timeout, hello=False)
        except OSError as exc:
            raise TargetError(f"cannot reach {self.target.address}: {exc.strerror or exc}") from None
        with client:
            try:
                fields = client.hello()
            except HandshakeError:
                fields = None  # a version the kit does not cover: server_version is set, the verdict says so
            except (ConnectionClosed, ProtocolError, OSError) as exc:
                raise TargetError(f"{self.target.address} does not answer HELLO as a ggml RPC server: {exc}") from None
            version = client.server_version
            assert version is not None
            self.info.version = version
            self.info.protocol, self.info.verdict = verdict_for(version)
            if fields is not None and self.info.protocol is not None:
                with contextlib.suppress(ConnectionClosed, ProtocolError, OSError):
                    self.info.device_count = client.device_count()

    def stop(self) -> None:
        self.finished_at = time.time()
        if self._started:
            self.target.stop()
            self._started = False

    def __enter__(self) -> Runner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- liveness --

    def server_alive(self) -> bool:
        """Does the server still accept a connection and answer HELLO?"""
        try:
            # Forced table: a version the kit does not cover still counts as an answer.
            with RpcClient.connect(self.target.host, self.target.port, timeout=self.probe_timeout, hello=False,
                                   protocol=self.info.protocol or V6) as c:
                c.hello()
                return True
        except (OSError, ConnectionClosed, ProtocolError):
            return False

    def await_ready(self, timeout: float) -> bool:
        """Poll (bounded by ``timeout``) until the server answers HELLO; False once its process has exited.

        A (re)started server may accept the port probe of :meth:`Target.start` and still refuse or not answer for
        a moment; a crashing one may linger (core dump) before it exits.  Either way the answer is waited for.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.target.process_exited():
                return False
            if self.server_alive():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    # -- running --

    def run(self, checks: Iterable[Check], progress: ProgressFn | None = None) -> list[Result]:
        for check in checks:
            result = self.run_one(check)
            if progress is not None:
                progress(result)
        return self.results

    def _not_applicable(self, check: Check) -> Result | None:
        info = self.info
        if self.dead_after is not None:
            return Result(check, Outcome.NOT_RUN,
                          self.stop_reason or f"server stopped answering after {self.dead_after}")
        if info.version is None:
            return Result(check, Outcome.NOT_RUN, "no handshake")
        if not info.covered and not check.any_version:
            return Result(check, Outcome.SKIP, f"server {info.verdict}; only handshake checks run")
        if info.covered and not check.any_version and not check.applies_to(info.version):
            return Result(check, Outcome.UNSUPPORTED, f"rule of protocol {check.versions_label}; server speaks "
                          f"{info.version_label}")
        return None

    def run_one(self, check: Check) -> Result:
        result = self._not_applicable(check)
        if result is None:
            # A spawned server found dead before the check starts died of something no check explains.
            early = self._unexplained(check) if self.target.process_exited() else []
            result = self._not_applicable(check)
            if result is None:
                ctx = Context(self, check)
                result = self._execute(ctx)
                if ctx.gone_before_start and not self.server_alive():
                    # The check's first connect found no server: nothing of it reached the server, so the death
                    # is not its own.  Reported as such; the check runs (once more) on the restarted server.
                    early += self._unexplained(check)
                    result = self._not_applicable(check)
                    if result is None:
                        ctx = Context(self, check)
                        result = self._execute(ctx)
                        self._after(check, result)
                else:
                    self._after(check, result)
                self._last_run = check.id
            result.evidence[:0] = early
        result.spec = check.spec_link(self.info.protocol)
        self.results.append(result)
        return result

    def _execute(self, ctx: Context) -> Result:
        check = ctx.check
        t0 = time.perf_counter()
        try:
            note = check.func(ctx)
            result = Result(check, Outcome.PASS, note or "")
        except CheckFailed as exc:
            level = exc.level or check.level
            result = Result(check, Outcome.FAIL, exc.message, failed_level=level,
                            interrupted=isinstance(exc, ServerGone) or _lost_connection(exc))
            ctx.evidence.append(exc.evidence)
        except Skipped as exc:
            result = Result(check, Outcome.SKIP, str(exc))
        except Unsupported as exc:
            result = Result(check, Outcome.UNSUPPORTED, str(exc))
        except ConnectionClosed as exc:
            result = self._broken(ctx, "the server closed the connection during a valid exchange", exc,
                                  "the reply, connection open")
        except ProtocolError as exc:
            result = self._broken(ctx, "the server's reply breaks the framing", exc, "a reply of the spec's size")
        except TimeoutError as exc:
            result = self._broken(ctx, f"no answer within {self.timeout:g} s", exc, "an answer")
        except OSError as exc:
            result = self._broken(ctx, "socket error", exc, "a working connection")
        except Exception as exc:  # a bug in the check, reported as such rather than as a server failure
            result = Result(check, Outcome.ERROR, f"check crashed: {type(exc).__name__}: {exc}",
                            failed_level=check.level)
            ctx.note("check crashed", got=f"{type(exc).__name__}: {exc}")
        finally:
            ctx.close_all()
        result.duration = time.perf_counter() - t0
        result.evidence = ctx.evidence
        return result

    @staticmethod
    def _broken(ctx: Context, what: str, exc: BaseException, expected: str) -> Result:
        """A check interrupted by the server's behaviour: a failure, with the exception as evidence."""
        detail = str(exc) or type(exc).__name__
        ctx.note(what, expected=expected, got=detail)
        return Result(ctx.check, Outcome.FAIL, f"{what}: {detail}", failed_level=ctx.check.level, interrupted=True)

    def _after(self, check: Check, result: Result) -> None:
        """Make sure the server survived; record a death and restart (spawned) or stop the run."""
        if self.server_alive():
            return
        # A spawned server still running may only be slow to answer (or still dumping core): wait for its answer or
        # its exit before judging, so the status names the signal rather than "not answering".
        if self.target.can_restart and self.await_ready(self.target.startup_wait):
            return
        death = self.target.death_info() or {"status": "no longer accepts connections"}
        # The step during which it died: the last one that sent something (later steps only found it gone),
        # else the last step the check noted (not the failure the death itself caused).
        failure_only = result.interrupted and result.evidence and not result.evidence[-1].sent
        noted = result.evidence[:-1] if failure_only else result.evidence
        steps = [e for e in noted if e.sent]
        step = steps[-1] if steps else (noted[-1] if noted else None)
        result.server_death = {**death, "step": step.step if step else None, "sent": step.sent if step else None}
        where = f" during step '{step.step}'" if step else ""
        # Only a spawned server's exit is known; an external one is only seen to stop answering.
        what = "server died" if self.target.process_exited() else "server stopped answering"
        result.evidence.append(Evidence(f"{what}{where}", sent=step.sent if step else None,
                                        expected="the server keeps accepting connections", got=death.get("status")))
        death_line = f"{what}{where} ({death.get('status')})"
        if not result.failed or result.interrupted:
            # A death is a SHOULD failure of the check that caused it, never a MUST failure nor a refused connect.
            said = f"; check said: {result.message}" if result.message and not result.interrupted else ""
            result.outcome = Outcome.FAIL
            result.failed_level = Level.SHOULD
            result.message = death_line + said
        else:
            result.message = f"{result.message}; then {death_line}"
        error = self._revive(check.id, f"server stopped answering after {check.id}")
        if error is not None:
            result.evidence.append(Evidence("restart failed", got=error))

    def _unexplained(self, check: Check) -> list[Evidence]:
        """Record a death found before ``check`` started (no check explains it) and restart the server."""
        death = self.target.death_info() or {"status": "no longer accepts connections"}
        after = self._last_run or "the handshake"
        self.unexplained_deaths.append({**death, "after": after, "before": check.id})
        evidence = [Evidence(f"the server was found dead before this check started (after {after}); "
                             "no check explains the death", expected="a running server", got=death.get("status"))]
        error = self._revive(after, f"server stopped answering before {check.id} (after {after})")
        if error is not None:
            evidence.append(Evidence("restart failed", got=error))
        return evidence

    def _revive(self, dead_after: str, stopped: str) -> str | None:
        """Restart a dead server and wait until it answers HELLO; else stop the run (``dead_after``: the last
        check it lived through, ``stopped``: why the rest is not run).  The restart error, or None."""
        error = None
        if self.target.can_restart:
            try:
                self.target.restart()
                # start() only saw the port accept a connection: the next check must find HELLO answered, not
                # lose a race with a server still coming up.
                if not self.await_ready(self.target.startup_wait):
                    info = self.target.death_info() if self.target.process_exited() else None
                    raise TargetError(f"restarted server on {self.target.address} does not answer HELLO"
                                      + (f" ({info['status']})" if info else ""))
                self.shared.clear()
                self.handshake()
                return None
            except TargetError as exc:
                error = str(exc)
        # The remaining checks are not run (not failed); the restart failure is reported once, by the caller.
        self.dead_after = dead_after
        self.stop_reason = stopped + (f"; restart failed: {error}" if error else "")
        return error

    # -- summary --

    def summary(self) -> dict[str, int]:
        counts = {o.value: 0 for o in Outcome}
        must = should = 0
        for r in self.results:
            counts[r.outcome.value] += 1
            if r.failed:
                if r.failed_level is Level.SHOULD:
                    should += 1
                else:
                    must += 1
        return {"total": len(self.results), **counts, "must_failures": must, "should_failures": should}

    def exit_code(self, strict: bool = False) -> int:
        s = self.summary()
        if s["must_failures"] or (strict and s["should_failures"]):
            return 1
        return 0


def _lost_connection(exc: BaseException) -> bool:
    """Was this failure raised while handling a broken connection (closed, reset, refused, timed out)?"""
    seen = 0
    cause: BaseException | None = exc.__cause__ or exc.__context__
    while cause is not None and seen < 8:  # `raise ... from None` keeps __context__: still the connection's loss
        if isinstance(cause, (ConnectionClosed, OSError)):
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False


def select(checks: Sequence[Check], patterns: str | None) -> list[Check]:
    """Checks whose ID or category matches one of the comma-separated shell patterns (case-insensitive)."""
    if not patterns:
        return list(checks)
    pats = [p.strip().upper() for p in patterns.split(",") if p.strip()]
    out = []
    for c in checks:
        names = (c.id.upper(), c.category.value.upper())
        if any(fnmatch.fnmatchcase(n, p) for p in pats for n in names):
            out.append(c)
    return out


def iter_groups(results: Iterable[Result]) -> Iterator[tuple[Category, list[Result]]]:
    """Results grouped by category, in category order."""
    by: dict[Category, list[Result]] = {}
    for r in results:
        by.setdefault(r.check.category, []).append(r)
    for cat in Category:
        if cat in by:
            yield cat, by[cat]


__all__ = [
    "SPEC_DOC", "Category", "Check", "CheckFailed", "Context", "EmbeddedTarget", "Evidence", "ExternalTarget",
    "Level", "Outcome", "Result", "Runner", "ServerInfo", "Skipped", "SpawnedTarget", "Target", "TargetError",
    "Unsupported", "format_address", "hexdump", "iter_groups", "parse_address", "select", "verdict_for",
]
