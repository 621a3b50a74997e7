"""Which node of a recorded graph first computes differently on the reference server and on upstream's.

A replay compares only what the client read back (the logits), so a session whose logits drift names no culprit.
This finder replays the capture against both servers up to one graph computation, then sends that graph once more
with every node given memory of its own (a fresh buffer: the client's allocator had nodes share memory, so most
intermediate results are overwritten before the graph ends), reads every node back from both servers, and lists the
nodes in execution order with the NMSE between the two results.  The first node above the bar is where the
reference stops computing as upstream does; its op, types and shapes say which kernel to look at.

The graph chosen by default is the one before the first read a replay finds above the bar.  Usage::

    python -m ggml_rpc.conformance.upstream.divergence SESSION.pcap [--at CONN:INDEX] [--bar 1e-9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.spec import Command, GgmlOp, Request, type_name
from ggml_rpc.spec.facts import tensor_nbytes

from ..client import RpcClient
from ..harness import parse_address
from ..nmse import nmse
from ..sessions.compare import FLOAT_TYPES, float_values
from ..sessions.replay import Replayer, load_captures, replay
from .peers import peer_for
from .runs import UpstreamServer, reference_server

#: Graph uid of the finder's own graph on a version with a graph cache (8.0.0): far from any client's.
_OWN_UID = (1 << 62) + 7


@dataclass
class _Node:
    """A node of the examined graph: where it runs, what it computes and from what."""

    position: int
    id: int
    name: str
    op: str
    type_id: int
    ne: list[int]
    sources: list[str]
    source_ids: list[int]

    @property
    def type(self) -> str:
        return type_name(self.type_id)


@dataclass
class NodeResult(_Node):
    """One node's result on one server."""

    data: bytes = b""


@dataclass
class NodeDiff(_Node):
    """One node compared across the two servers."""

    nmse: float | None = None  # None: not a float type, compared byte for byte
    equal_bytes: bool = False


def _op_name(op: int) -> str:
    try:
        return GgmlOp(op).name
    except ValueError:
        return f"op {op}"


def _nbytes(t: np.void) -> int:
    return int(tensor_nbytes({"type": int(t["type"]), "ne": [int(n) for n in t["ne"]],
                              "nb": [int(n) for n in t["nb"]]}))


def _describe(t: np.void) -> str:
    return f"{t['name'].decode(errors='replace')} ({type_name(int(t['type']))} {list(int(n) for n in t['ne'])})"


def node_results(client: RpcClient, fields: dict[str, Any]) -> list[NodeResult]:
    """Compute the graph ``fields`` (a relocated GRAPH_COMPUTE) once more with every node in memory of its own, and
    read every node back."""
    tensors = np.array(fields["tensors"], copy=True)
    nodes = [int(n) for n in fields["nodes"]]
    device = int(fields.get("device", 0))
    index = {int(t["id"]): i for i, t in enumerate(tensors)}
    align = max(int(client.get_alignment(device)), 1)
    own: dict[int, int] = {}  # node id -> offset in the new buffer
    total = 0
    for nid in nodes:
        t = tensors[index[nid]]
        if int(t["view_src"]) == 0 and int(t["data"]) != 0:
            own[nid] = total
            total += -(-_nbytes(t) // align) * align
    if not own:
        return []
    handle, size = client.alloc_buffer(device, total)
    if not handle or size < total:
        raise RuntimeError(f"the server could not allocate {total} bytes for the graph's {len(own)} nodes")
    try:
        base = client.buffer_get_base(handle)
        for nid, offset in own.items():
            t = tensors[index[nid]]
            t["buffer"], t["data"] = int(handle), int(base) + offset
        # Views of a node follow it into the new buffer (a view names its base tensor, never another view).
        for t in tensors:
            src = int(t["view_src"])
            if src in own:
                t["buffer"], t["data"] = int(handle), int(base) + own[src] + int(t["view_offs"])
        # 8.0.0 keeps graphs by uid: the finder's own one never replaces a graph of the client's.
        client.graph_compute(device, np.asarray(fields["nodes"]), tensors, uid=_OWN_UID if "uid" in fields else None)
        out = []
        for position, nid in enumerate(nodes):
            t = tensors[index[nid]]
            if int(t["data"]) == 0 or int(t["buffer"]) != handle:
                continue  # a view of a weight or of the KV cache: what it wrote is read through its own node
            row = {name: t[name] for name in tensors.dtype.names}
            data = bytes(client.get_tensor(row, 0, _nbytes(t)))
            ids = [int(s) for s in t["src"] if int(s) and int(s) in index]
            sources = [_describe(tensors[index[i]]) for i in ids]
            # A view's source is also what it was cut from: a consumer of the view sees the base's difference.
            if int(t["view_src"]) in index:
                ids.append(int(t["view_src"]))
            out.append(NodeResult(position, nid, t["name"].decode(errors="replace"), _op_name(int(t["op"])),
                                  int(t["type"]), [int(n) for n in t["ne"]], sources, ids, data))
        return out
    finally:
        client.free_buffer(handle)


class _Stop:
    """The replay hook: remembers the chosen connection's last graph, and at the chosen computation reads every node
    (and ends that connection's replay)."""

    def __init__(self, conn: int, index: int) -> None:
        self.conn, self.index = conn, index
        self.graph: dict[str, Any] | None = None
        self.results: list[NodeResult] | None = None

    def __call__(self, client: RpcClient, cmd: Command, fields: dict[str, Any], req: Request, conn: int) -> bool:
        if conn != self.conn:
            return True  # the other connections set up the state, replayed as recorded
        if cmd is Command.GRAPH_COMPUTE:
            self.graph = fields
        if req.index != self.index or self.results is not None or self.graph is None:
            return True
        self.results = node_results(client, self.graph)
        return False


def graph_nodes(pcap: Path, address: str, conn: int, index: int) -> list[NodeResult]:
    """Replay ``pcap`` against ``address`` up to message ``index`` of connection ``conn`` (a graph computation) and
    return every node of that graph as the server computes it (:func:`node_results`)."""
    hook = _Stop(conn, index)
    Replayer(load_captures([pcap]), *parse_address(address), graph_hook=hook).run(check_alive=False)
    if hook.results is None:
        raise RuntimeError(f"connection {conn} of {pcap} has no graph computation at message {index}")
    return hook.results


def first_drift(pcap: Path, address: str, bar: float) -> tuple[int, int] | None:
    """(connection, message index) of the graph computation before the first read above ``bar``; None if none."""
    report = replay([pcap], *parse_address(address), nmse_tolerance=bar)
    drift = [m for m in report.mismatches if m.kind == "computed"]
    if not drift:
        return None
    first = drift[0]
    for cap in load_captures([pcap]):
        for dc in cap.connections:
            if dc.conn.index != first.connection:
                continue
            computes = [r.index for r in dc.requests if r.index < first.index
                        and r.command in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)]
            if computes:
                return first.connection, computes[-1]
    return None


def compare(reference: list[NodeResult], upstream: list[NodeResult]) -> list[NodeDiff]:
    """Every node both servers computed, in order: NMSE of the reference's result against upstream's (float types,
    read as a replay reads a computed result) and whether the bytes are equal."""
    by_pos = {r.position: r for r in upstream}
    out = []
    for mine in reference:
        theirs = by_pos.get(mine.position)
        if theirs is None:
            continue
        dtype = FLOAT_TYPES.get(mine.type_id)
        err = None
        if dtype is not None and len(mine.data) == len(theirs.data):
            err = nmse(float_values(theirs.data, dtype), float_values(mine.data, dtype))
        shared = {f.name: getattr(mine, f.name) for f in dataclass_fields(_Node)}
        out.append(NodeDiff(**shared, nmse=err, equal_bytes=mine.data == theirs.data))
    return out


def differing(diffs: list[NodeDiff], bar: float) -> list[NodeDiff]:
    """The nodes above ``bar`` whose difference reaches the graph's last node (its result), in order.

    A difference nothing downstream sees is not where a drift starts: upstream fuses some ops (RMS_NORM into the
    MUL after it), writes only the fused result and leaves the first op's own memory as it was, and an input the
    graph does not use this step holds whatever the buffer held.  (A key or value written into the cache reaches
    the result only at the next step: there, attention over the cache is the first node to differ.)"""
    def off(d: NodeDiff) -> bool:
        return (d.nmse is not None and d.nmse > bar) or (d.nmse is None and not d.equal_bytes)

    consumers: dict[int, list[NodeDiff]] = {}
    for d in diffs:
        for src in d.source_ids:
            consumers.setdefault(src, []).append(d)
    reaches: dict[int, bool] = {}
    for d in reversed(diffs):
        later = [c for c in consumers.get(d.id, []) if c.position > d.position]
        reaches[d.position] = off(d) and (d is diffs[-1] or any(reaches.get(c.position, False) for c in later))
    return [d for d in diffs if reaches[d.position]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ggml_rpc.conformance.upstream.divergence",
                                description="Find the first node of a recorded graph that the reference computes "
                                "differently from upstream.")
    p.add_argument("pcap", type=Path)
    p.add_argument("--proto", type=int, default=7, help="the upstream peer's major version (default 7)")
    p.add_argument("--at", metavar="CONN:INDEX", help="the GRAPH_COMPUTE/RECOMPUTE to examine (default: the one "
                   "before the first read above the bar)")
    p.add_argument("--bar", type=float, default=1e-9, help="NMSE above which a node differs (default 1e-9)")
    p.add_argument("--json", metavar="FILE", help="write every node's comparison here")
    args = p.parse_args(argv)
    if not args.pcap.is_file():
        print(f"divergence: {args.pcap}: no such file", file=sys.stderr)
        return 2
    peer = peer_for(args.proto)
    with tempfile.TemporaryDirectory() as cache, reference_server(peer.major, Path(cache)) as ref:
        if args.at:
            conn_text, _, index_text = args.at.partition(":")
            at: tuple[int, int] | None = (int(conn_text), int(index_text))
        else:
            at = first_drift(args.pcap, ref, args.bar)
        if at is None:
            print(f"every read of {args.pcap} is within NMSE {args.bar:g} on the reference server")
            return 0
        mine = graph_nodes(args.pcap, ref, *at)
    with UpstreamServer(peer, cache=False) as up:
        theirs = graph_nodes(args.pcap, up.address, *at)
    diffs = compare(mine, theirs)
    above = differing(diffs, args.bar)
    print(f"{args.pcap.name}: connection {at[0]}, message {at[1]}: {len(diffs)} nodes, {len(above)} differ")
    for d in diffs:
        mark = "*" if d in above[:1] else " "
        err = "bytes equal" if d.equal_bytes else ("bytes differ" if d.nmse is None else f"NMSE {d.nmse:.1e}")
        print(f"{mark}{d.position:4d} {d.op:<16} {d.type:<5} {d.ne!s:<22} {err:<14} {d.name}  <- "
              f"{', '.join(d.sources)}")
    if args.json:
        nodes = [asdict(d) | {"type": d.type} for d in diffs]
        Path(args.json).write_text(json.dumps({"pcap": str(args.pcap), "at": list(at), "bar": args.bar,
                                               "nodes": nodes}, indent=1) + "\n")
    return 1 if above else 0


if __name__ == "__main__":
    sys.exit(main())
