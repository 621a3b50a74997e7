"""Replaying captures that hold connections to several servers (a model split over a fleet), each recorded server's
connections against a target of its own, all servers at once.

A split client talks to every server at the same time: with tensor split (8.0.0) one server's COMM_INIT waits for
the other's, and each COMM_ALLREDUCE needs both ranks, so the servers' connections are replayed concurrently (one
thread per recorded server, its connections in their recorded order).  COMM_INIT is readdressed for the fleet:
rank 0's port becomes a free port of its target's host, and rank 1 is sent there.  The servers' own link is not
replayed (the targets open their own); it is decoded from the capture like any connection.

With a single target every connection goes to it, in capture order (:class:`~.replay.Replayer` as usual).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ggml_rpc.spec import Command

from .compare import DEFAULT_NMSE, ReplayReport
from .op_closeness import merge_by_op
from .replay import LoadedCapture, Replayer, ReplayError

Address = tuple[str, int]


def recorded_servers(captures: Sequence[LoadedCapture]) -> list[Address]:
    """The servers the captures' client connections went to, in the order of their first connection (the servers'
    own links left out)."""
    seen: dict[Address, None] = {}
    for cap in captures:
        for dc in sorted(cap.connections, key=lambda d: d.conn.start):
            if dc.link is None:
                seen.setdefault(dc.conn.server, None)
    return list(seen)


class CommAddresses:
    """COMM_INIT readdressed for the fleet: each recorded rank-0 port gets a free port of the target that plays the
    rank-0 server, and rank 1 is sent to that target."""

    def __init__(self, captures: Sequence[LoadedCapture], targets: dict[Address, Address],
                 free_port: Callable[[str], int]) -> None:
        self._ports: dict[int, Address] = {}
        for cap in captures:
            for dc in cap.connections:
                for req in dc.requests:
                    if req.command is Command.COMM_INIT and req.fields["rank"] == 0:
                        host = targets[dc.conn.server][0]
                        self._ports.setdefault(req.fields["port"], (host, free_port(host)))

    def rewrite(self, command: Command, fields: dict[str, Any]) -> dict[str, Any]:
        if command is not Command.COMM_INIT or fields["port"] not in self._ports:
            return fields
        host, port = self._ports[fields["port"]]
        out = {**fields, "port": port}
        if fields["rank"] != 0:
            out["host"] = host.encode().ljust(len(fields["host"]), b"\0")
        return out


def merge(reports: Sequence[ReplayReport], target: str, seconds: float) -> ReplayReport:
    """One report for the fleet: counts added, findings and notes kept in server order."""
    out = ReplayReport(target=target, source_versions=sorted({v for r in reports for v in r.source_versions}),
                       target_version="/".join(sorted({r.target_version for r in reports})))
    for r in reports:
        out.connections += r.connections
        out.requests += r.requests
        for key, n in r.compared.items():
            out.compared[key] = out.compared.get(key, 0) + n
        out.mismatches += r.mismatches
        out.cuts += r.cuts
        out.notes += r.notes
        out.bytes_sent += r.bytes_sent
        out.bytes_received += r.bytes_received
        out.worst_nmse = max(out.worst_nmse, r.worst_nmse)
        merge_by_op(out.nmse_by_op, r.nmse_by_op)
    out.seconds = seconds
    return out


def replay_fleet(
    captures: Sequence[LoadedCapture],
    targets: Sequence[Address],
    *,
    free_port: Callable[[str], int],
    nmse_tolerance: float = DEFAULT_NMSE,
    timeout: float = 120.0,
) -> ReplayReport:
    """Replay each recorded server's connections against ``targets[i]`` (the i-th server by first connection)."""
    servers = recorded_servers(captures)
    if len(targets) != len(servers):
        listed = ", ".join(f"{h}:{p}" for h, p in servers)
        raise ReplayError(f"the captures hold connections to {len(servers)} server(s) ({listed}): give one target "
                          f"for all, or one per server ({len(targets)} given)")
    mapping = dict(zip(servers, targets, strict=True))
    comm = CommAddresses(captures, mapping, free_port)
    players = []
    for server, (host, port) in mapping.items():
        mine = [LoadedCapture(cap.path, [dc for dc in cap.connections if dc.link is None and
                                         dc.conn.server == server]) for cap in captures]
        players.append(Replayer(mine, host, port, nmse_tolerance=nmse_tolerance, timeout=timeout,
                                rewrite_fields=comm.rewrite))
    errors: list[BaseException] = []

    def play(r: Replayer) -> None:
        try:
            r.run()
        except BaseException as exc:  # reported below, from the caller's thread
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=play, args=(r,), name=f"replay-{r.host}:{r.port}") for r in players]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return merge([r.report for r in players], ", ".join(f"{h}:{p}" for h, p in targets),
                 time.perf_counter() - start)


__all__ = ["CommAddresses", "merge", "recorded_servers", "replay_fleet"]
