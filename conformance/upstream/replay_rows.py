"""The matrix's REPLAY rows: a recorded upstream session replayed against the reference server or upstream."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cells import FAIL, PASS, UNSUPPORTED, Cell
from .peers import Peer
from .runs import UpstreamServer, reference_server

if TYPE_CHECKING:
    from .matrix import Workspace


#: The closeness a replay row asks of every computed read: upstream's results reproduced to NMSE 1e-9, where
#: replay's own tolerance (test-backend-ops') only separates a right result from a wrong one.
REPLAY_NMSE_BAR = 1e-9


def _above_bar(by_op: dict[str, dict[str, Any]], bar: float) -> str:
    """The ops whose reads were above ``bar``, worst first, with the source 0 types that were."""
    worst = sorted(((fig["worst_nmse"], op, fig) for op, fig in by_op.items() if fig["worst_nmse"] > bar),
                   reverse=True)
    parts = []
    for nmse, op, fig in worst:
        types = [t for t, sub in fig.get("by_src0_type", {}).items() if sub["worst_nmse"] > bar]
        parts.append(f"{op} {nmse:.1e}" + (f" ({', '.join(types)})" if types else ""))
    return ", ".join(parts)


def replay_row(peer: Peer, ws: Workspace, model: str, against: str) -> Cell:
    """``ggml-rpc replay`` of the recorded upstream session against the reference server or upstream: 0 mismatches;
    for a zoo model, every computed read within :data:`REPLAY_NMSE_BAR` of upstream's (the standard models' rows
    report where they stand against it)."""
    from ggml_rpc.conformance.harness import parse_address
    from ggml_rpc.conformance.sessions.replay import replay

    pcap = ws.recorded.get((peer.version, model))
    if pcap is None:
        return Cell(UNSUPPORTED, "no recorded session (its proxy row did not pass)")
    if against == "reference":
        with tempfile.TemporaryDirectory(dir=ws.root, prefix="ref-cache-") as cache, \
                reference_server(peer.major, Path(cache)) as address:
            report = replay([pcap], *parse_address(address))
    else:
        with UpstreamServer(peer, cache=True) as server:
            report = replay([pcap], *parse_address(server.address))
    figures = {"requests": report.requests, "compared": report.compared, "worst_nmse": report.worst_nmse,
               "mismatches": len(report.mismatches), "nmse_bar": REPLAY_NMSE_BAR, "nmse_by_op": report.nmse_by_op}
    if report.mismatches:
        return Cell(FAIL, f"{len(report.mismatches)} mismatches, first: {report.mismatches[0]}", figures)
    if not report.compared.get("computed"):
        # A session of a generation whose results were never compared judged nothing: never a pass.
        return Cell(FAIL, f"{report.requests} requests, but no computed result was compared", figures)
    over = report.worst_nmse > REPLAY_NMSE_BAR
    # The worst read may be of an address no graph node names: over the bar all the same.
    above = (_above_bar(report.nmse_by_op, REPLAY_NMSE_BAR) or "a read no graph node names") if over else ""
    figures["bar_met"] = not over
    if above and model in ws.zoo:
        return Cell(FAIL, f"{report.requests} requests, 0 mismatches, but worst NMSE {report.worst_nmse:.1e} is above "
                          f"{REPLAY_NMSE_BAR:.0e}: {above}", figures)
    where = f"above the {REPLAY_NMSE_BAR:.0e} bar: {above}" if above else f"within the {REPLAY_NMSE_BAR:.0e} bar"
    return Cell(PASS, f"{report.requests} requests, 0 mismatches (worst NMSE {report.worst_nmse:.1e}, {where})",
                figures)
