"""Interop rows of a model split over two servers: genuine clients against fleets of genuine and reference servers.

Each row runs the upstream client with the model split by ``layer`` (whole layers per server, every version) or by
``tensor`` (each weight cut across both servers, which then sum partial results over a link of their own: 8.0.0)
over a fleet of two servers — [upstream, upstream], [reference, reference] or the mixed [upstream, reference], and
[upstream, another genuine build of the version] (the wheel's 8.0.0 beside Debian's) — through one ``ggml-rpc
proxy --check`` fronting both.  It passes when the text is the client's CPU-only text, the
proxy saw no violation, and the recording, replayed against two fresh reference servers (each recorded server's
connections against its own, all at once), gives 0 mismatches.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ggml_rpc.conformance.harness import free_port, parse_address
from ggml_rpc.conformance.sessions.fleet import replay_fleet
from ggml_rpc.conformance.sessions.proxy import running_proxy
from ggml_rpc.conformance.sessions.replay import load_captures

from .cells import FAIL, PASS, Cell, Row
from .peers import Peer
from .runs import UpstreamServer, generated_text, reference_server, split_completion
from .workspace import Workspace

#: The fleets every split runs on: who serves each half.
FLEETS: tuple[tuple[str, str], ...] = (("upstream", "upstream"), ("reference", "reference"), ("upstream", "reference"))

#: A fleet member: the peer's own server, the reference, or another genuine build of the same version.
Member = str | Peer


def splits_of(peer: Peer) -> tuple[str, ...]:
    """How a version's client can split a model over RPC servers."""
    return ("layer", "tensor") if peer.major >= 8 else ("layer",)


@contextlib.contextmanager
def _fleet(peer: Peer, kinds: tuple[Member, ...], root: Path) -> Iterator[list[tuple[str, int]]]:
    with contextlib.ExitStack() as stack:
        addresses = []
        for kind in kinds:
            if kind == "upstream" or isinstance(kind, Peer):
                server = stack.enter_context(UpstreamServer(kind if isinstance(kind, Peer) else peer, cache=False))
                addresses.append(parse_address(server.address))
            else:
                cache = Path(tempfile.mkdtemp(dir=root, prefix="ref-cache-"))
                addresses.append(parse_address(stack.enter_context(reference_server(peer.major, cache))))
        yield addresses


def _name(kind: Member) -> str:
    """A fleet member in file names and titles: upstream, reference, or the other build's label."""
    return kind.label if isinstance(kind, Peer) else kind


def split_row(peer: Peer, ws: Workspace, model: str, split: str, kinds: tuple[Member, ...]) -> Cell:
    """The genuine client splits ``model`` by ``split`` over the fleet ``kinds`` (see the module's text)."""
    expected = ws.baseline(peer, model)
    pcap = ws.pcap_dir / f"{peer.tag}-split-{split}-{'-'.join(map(_name, kinds))}-{model}.pcap"
    violations: list[str] = []
    with _fleet(peer, kinds, ws.root) as servers:
        with running_proxy(servers, pcap=pcap, check=True, on_violation=lambda v: violations.append(v.line())) \
                as proxy:
            done = split_completion(peer, ws.models(peer)[model], [f"{h}:{p}" for h, p in proxy.addresses], split)
    figures: dict[str, object] = {"violations": len(violations), "pcap": pcap.name,
                                  "seconds_generation": round(done.seconds, 2)}
    if not done.ok:
        return Cell(FAIL, f"the client failed: {done.why()}", figures)
    problems = []
    if generated_text(done.stdout) != expected:
        problems.append(f"text differs from the CPU-only run: {generated_text(done.stdout)!r} vs {expected!r}")
    if violations:
        problems.append(f"{len(violations)} violations, first: {violations[0]}")
    with _fleet(peer, ("reference", "reference"), ws.root) as targets:
        report = replay_fleet(load_captures([pcap]), targets, free_port=free_port, timeout=120)
    figures |= {"replay_requests": report.requests, "replay_connections": report.connections,
                "replay_worst_nmse": report.worst_nmse, "replay_mismatches": len(report.mismatches)}
    if report.mismatches:
        problems.append(f"replay: {len(report.mismatches)} mismatches, first: {report.mismatches[0].line()}")
    if problems:
        return Cell(FAIL, "; ".join(problems), figures)
    return Cell(PASS, f"same text as CPU-only, 0 violations; replayed against two reference servers: "
                      f"{report.requests} requests, 0 mismatches (worst NMSE {report.worst_nmse:.1e})", figures)


def _short(kind: Member) -> str:
    if isinstance(kind, Peer):
        return kind.kind.upper()  # WHEEL, DEBIAN: the other build
    return "UP" if kind == "upstream" else "REF"


def split_rows(peer: Peer, ws: Workspace, model: str, partners: Sequence[Peer] = ()) -> Iterator[Row]:
    """Every split of ``peer``'s client over every fleet, with ``model``; with each of ``partners`` (other genuine
    builds of the version) serving beside ``peer``'s own server in one fleet more."""
    v = peer.tag
    fleets: list[tuple[Member, ...]] = [*FLEETS, *(("upstream", other) for other in partners)]
    for split in splits_of(peer):
        for kinds in fleets:
            fleet = "-".join(map(_short, kinds))
            yield Row(f"SPLIT-{v}-{split.upper()}-{fleet}",
                      f"upstream {v} client, {model} split by {split} over [{', '.join(map(_name, kinds))}] through "
                      "one proxy; the recording replayed against two reference servers", peer.version,
                      lambda p=peer, s=split, k=kinds: split_row(p, ws, model, s, k))


__all__ = ["FLEETS", "split_row", "split_rows", "splits_of"]
