"""What a check function gets and what it may raise: the server's version and facts (:class:`ServerInfo`), fresh
connections and shared facts (:class:`Context`), over what it may know of the run (:class:`RunFacts`: never the
runner itself); the observations it records (:class:`Evidence`) and its ways to end (:class:`CheckFailed` and its
kinds, :class:`Skipped`, :class:`Unsupported`)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.spec import PROTOCOLS, V6, Protocol, protocol_for
from ggml_rpc.spec.rules import Level

from ..client import RpcClient
from .exchange import Recorder
from .targets import Target, wait_for_port


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


class Blocked(CheckFailed):
    """The server refused what the harness needs to test a rule (its setup), not the rule itself.

    ``cause`` names the refusal in words shared by every check it blocks (the report gives it once); the message
    and evidence say what this check asked for.  A subclass of :class:`CheckFailed` so that code catching failures
    around a setup step keeps working.
    """

    def __init__(self, message: str, *, cause: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.cause = cause


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


#: The seed of a run that names none: fixed, so that two runs send the same inputs unless asked otherwise.
DEFAULT_SEED = 0x5EED


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What a check may know of the run it is part of (the runner hands each check these, not itself)."""

    target: Target
    #: What the handshake taught; the runner updates it in place after a restart.
    info: ServerInfo
    #: Seconds a check waits for an answer.
    timeout: float
    #: The run's seed (see :meth:`Context.rng`).
    seed: int
    #: The version the run was asked to find (``--proto``), or None.
    expect: Protocol | None
    #: Facts computed once per server start and shared between checks (the runner empties it on a restart).
    shared: dict[str, Any]


class Context:
    """What a check function gets: the server's address and version, fresh connections, shared facts."""

    def __init__(self, run: RunFacts, check_id: str) -> None:
        self.run = run
        #: The ID of the check this context serves (its inputs are drawn from it, see :meth:`rng`).
        self.check_id = check_id
        self.evidence: list[Evidence] = []
        #: Every byte of the connections this check opens (see :mod:`.exchange`).
        self.recorder = Recorder()
        self._clients: list[RpcClient] = []
        #: Connections this check opened; none when its first connect already found no server.
        self.connections = 0
        #: The check's very first connect found no server: it died before the check, of something else.
        self.gone_before_start = False

    @property
    def info(self) -> ServerInfo:
        return self.run.info

    @property
    def protocol(self) -> Protocol:
        assert self.run.info.protocol is not None
        return self.run.info.protocol

    @property
    def version(self) -> tuple[int, int, int]:
        assert self.run.info.version is not None
        return self.run.info.version

    @property
    def expect(self) -> Protocol | None:
        """The version the run was asked to find, or None."""
        return self.run.expect

    @property
    def timeout(self) -> float:
        return self.run.timeout

    def rng(self) -> np.random.Generator:
        """The generator this check draws its inputs from: the run's seed and the check's ID, so a check sends the
        same bytes whether it runs alone (``--checks``) or after others.  (Payloads that must differ on every run,
        so that a cache an earlier run filled never answers, are :func:`~ggml_rpc.conformance.checks._support.nonce`
        bytes, not drawn from here.)"""
        return np.random.default_rng([self.run.seed, zlib.crc32(self.check_id.encode())])

    @property
    def cache_dir(self) -> Path | None:
        return self.run.target.cache_dir

    @property
    def target(self) -> Target:
        return self.run.target

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
        target = self.run.target
        # One deadline for all retries: a server flapping between accepting and refusing cannot loop forever.
        deadline = time.monotonic() + target.startup_wait
        while True:
            try:
                # Through the check's recorder: every byte is kept for its pcap and HTML page.
                client = RpcClient.connect(target.host, target.port, timeout=timeout or self.timeout,
                                           protocol=protocol or self.run.info.protocol or V6,  # HELLO: all alike
                                           hello=hello, wrap=self.recorder.wrap)
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
        target = self.run.target
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
        cache = self.run.shared
        if key not in cache:
            cache[key] = compute()
        return cache[key]
