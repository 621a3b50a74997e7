"""Rewriting a captured session for a server of another version (``ggml-rpc replay --as``), where that is sound.

6 <-> 7: SET_TENSOR gains or loses its cache_flag (see :mod:`.replay`).  7 or 6 -> 8: every GRAPH_COMPUTE gets a
uid of its own (1, 2, … per connection, as upstream's client numbers them) and GRAPH_RECOMPUTE names the device's
last one, which is what a 6/7 server re-runs.  8 -> 7 or 6: the uid is dropped; a GRAPH_RECOMPUTE of the device's
last graph stays one, a GRAPH_RECOMPUTE of an older uid becomes a GRAPH_COMPUTE of the graph recorded under it (a
6/7 server keeps one graph per device; computing it again gives the same result).  Commands the target version
does not have (SET/GET_TENSOR_2D, COMM_*, GET_DEVICE_SUPPORTS_OP) have no sound single-message equivalent: the
replay is refused before a byte is sent, naming the first such request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ggml_rpc.spec import Command, Protocol

from .decode import DecodedConnection

_GRAPH = (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)


class RewriteRefused(Exception):
    """The session cannot be rewritten for the target version (the message says where and why)."""


def check_rewritable(connections: Iterable[tuple[str, DecodedConnection]], target: Protocol) -> None:
    """Raise :class:`RewriteRefused` for the first request whose command the target version does not have."""
    for path, dc in connections:
        if dc.protocol is None or dc.protocol is target:
            continue
        for req in dc.requests:
            if req.command not in target.commands:
                raise RewriteRefused(
                    f"{path}: connection {dc.conn.index}, message {req.index}: {req.command.name} of "
                    f"{dc.protocol.label} has no equivalent in {target.label} (no single message does what it "
                    "does): replay it against a server of its own version")


class GraphRewrite:
    """Graph uids across versions for one connection (see the module's text)."""

    def __init__(self, source: Protocol, target: Protocol) -> None:
        self.add_uids = source.graph_cache_max is None and target.graph_cache_max is not None
        self.drop_uids = source.graph_cache_max is not None and target.graph_cache_max is None
        self._next_uid = 0
        self._last: dict[int, int] = {}  # device -> uid of the last graph computed on it
        self._graphs: dict[tuple[int, int], dict[str, Any]] = {}  # 8 -> 7: (device, uid) -> its GRAPH_COMPUTE

    @property
    def active(self) -> bool:
        return self.add_uids or self.drop_uids

    def request(self, command: Command, fields: dict[str, Any]) -> tuple[Command, dict[str, Any]]:
        """The (command, fields) to send for a (relocated) GRAPH_COMPUTE / GRAPH_RECOMPUTE."""
        if command not in _GRAPH or not self.active:
            return command, fields
        device = fields["device"]
        if self.add_uids:
            if command is Command.GRAPH_COMPUTE:
                self._next_uid += 1
                self._last[device] = self._next_uid
            return command, {**fields, "uid": self._last.get(device, 0)}
        uid = fields["uid"]
        bare = {k: v for k, v in fields.items() if k != "uid"}
        if command is Command.GRAPH_COMPUTE:
            self._last[device] = uid
            if uid:
                self._graphs[(device, uid)] = bare
            return command, bare
        if self._last.get(device) == uid or (device, uid) not in self._graphs:
            return command, bare  # the device's last graph (or one the target never had: it closes, as recorded)
        self._last[device] = uid
        return Command.GRAPH_COMPUTE, self._graphs[(device, uid)]


__all__ = ["GraphRewrite", "RewriteRefused", "check_rewritable"]
