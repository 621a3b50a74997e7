"""``ggml-rpc replay --spawn CMD``: replay against a server the replayer starts, restarted after each death.

As ``check --spawn`` does, the target is started from CMD (``{port}``: a free port), and every death is attributed:
the exit status or signal (from the process itself, not guessed from a refused connect), the connection and the
last message sent before it (file, index, command), and the last lines the server printed.  The server is then
restarted and the replay goes on, so one run shows every message that kills it, not only the first; a
connection that found the server already dead (its death showed as a refused connect) is replayed again on the
restarted one.  Each connection is followed by a HELLO probe, so a death is found before the next connection
starts, not blamed on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..sessions.compare import Mismatch
from ..sessions.decode import DecodedConnection
from ..sessions.relocate import TargetCache
from ..sessions.replay import DEATH, LoadedCapture, Replayer, ReplayError, _TargetStopped
from .spawned import SpawnedTarget
from .targets import TargetError

#: The mismatch kind of a sanitizer report the server printed and survived (an instrumented build's UBSan).
SANITIZER = "sanitizer"


class SpawnedReplayer(Replayer):
    """A :class:`~ggml_rpc.conformance.sessions.replay.Replayer` whose target is a :class:`~.targets.SpawnedTarget`
    (started by the caller)."""

    def __init__(self, captures: Sequence[LoadedCapture], spawned: SpawnedTarget, **kwargs: Any) -> None:
        super().__init__(captures, spawned.host, spawned.port, **kwargs)
        self.spawned = spawned
        self.deaths = 0
        self._played: dict[tuple[str, int], DecodedConnection] = {}
        self._sanitizer_mark = spawned.sanitizer_count

    def _play(self, path: str, dc: DecodedConnection) -> None:
        self._played[(path, dc.conn.index)] = dc
        try:
            self._connection(path, dc)
        except _TargetStopped as exc:
            # It died of what an earlier connection sent: record that death, then replay this connection afresh.
            self._death(str(exc))
            self._connection(path, dc)  # a fresh server that refuses at once again ends the replay (run())
        # Probed before the next connection: a server still dying of this one's last message may accept it yet
        # (its listener not closed) and reset it, a death the next connection's HELLO would be blamed for.
        self._not_answering()
        self._sanitizer_reports(path, dc)

    def _sanitizer_reports(self, path: str, dc: DecodedConnection) -> None:
        """Reports an instrumented server printed during this connection and survived: one mismatch each (a
        fatal report is part of the death's)."""
        reports = [r for r in self.spawned.sanitizer_reports(self._sanitizer_mark) if not r.fatal]
        self._sanitizer_mark = self.spawned.sanitizer_count
        last = dc.requests[-1] if dc.requests else None
        for report in reports[:10]:
            self.report.mismatches.append(Mismatch(
                path, dc.conn.index, last.index if last else 0, last.command.name if last else "?", SANITIZER,
                "no sanitizer report", f"during connection {dc.conn.index} of {path}: {report.headline()}"))

    def _death(self, how: str | None) -> None:
        """Record the spawned server's death after the last message sent, and restart it."""
        info = self.spawned.death_info() or {}
        status = info.get("status") or how or "no longer accepts connections"
        self._sanitizer_mark = self.spawned.sanitizer_count  # a fatal report is told by the death's status
        path, conn, index, command = self._last or ("?", 0, 0, "?")
        answered = f" (last reply: message {self._answered[0]}, {self._answered[1]})" if self._answered else ""
        tail = " | ".join(info.get("log_tail", [])[-3:])
        self.deaths += 1
        self.report.mismatches.append(Mismatch(
            path, conn, index, command, DEATH, "the server to outlive every message",
            f"the server died ({status}) after message {index} ({command}) of connection {conn} of {path}{answered}"
            + self._suspects(path, conn, index) + (f"; its last output: {tail}" if tail else "")))
        try:
            self.spawned.restart()
        except TargetError as exc:
            raise ReplayError(f"the server could not be restarted after it died: {exc}") from None
        self.host, self.port = self.spawned.host, self.spawned.port
        self.report.notes.append(f"restarted the server after death {self.deaths} (now {self.spawned.address})")
        if self.spawned.cache_dir is None:
            self.cache = TargetCache(self.target)  # a fresh process has an empty cache unless it keeps a folder
        self._last, self._answered = None, None

    def _suspects(self, path: str, conn: int, index: int) -> str:
        """The messages sent since the last one a reply was due for: one of them killed it (a no-reply command
        such as GRAPH_COMPUTE is followed by the next request before any answer can show the death)."""
        dc = self._played.get((path, conn))
        if dc is None:
            return ""
        sent = [r for r in dc.requests if r.index <= index]
        start = len(sent) - 1
        while start > 0 and not ((spec := self.target.spec(sent[start - 1].command)) is not None and spec.has_reply):
            start -= 1
        if start >= len(sent) - 1:
            return ""
        return "; sent since the last reply was due: " + ", ".join(f"{r.index} {r.command.name}"
                                                                   for r in sent[start:])

    def _not_answering(self) -> str | None:
        """At the end: a server that died of the last message is named by its status (and restarted, as after any
        death), not only as a refused connect."""
        why = None if self.spawned.process_exited() else super()._not_answering()
        if why is not None or self.spawned.process_exited():
            self._death(why)
        return None


__all__ = ["SpawnedReplayer"]
