"""``ggml-rpc replay FILE.pcap [...]``: send the captured client side again and compare the replies."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from typing import TextIO

from ggml_rpc.spec import Protocol

from ..harness import free_port
from ..sessions.capture import CaptureError
from ..sessions.compare import DEFAULT_NMSE, ReplayReport
from ..sessions.fleet import recorded_servers, replay_fleet
from ..sessions.replay import (
    DEATH,
    GREETING_TIMEOUT,
    LoadedCapture,
    Replayer,
    ReplayError,
    load_captures,
    source_protocol,
)
from .console import ready_kernels
from .options import (
    PROTO_SPELLINGS,
    STDOUT,
    UsageError,
    output_file,
    parse_address,
    parse_proto,
    proto_help,
    write_output,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Replays the client side of every connection of the captures, in order, against "
        "one server, relocating buffer handles and addresses, and compares each reply by class "
        "(exact, recorded, computed within an NMSE tolerance). Exit code 1 on any mismatch, and when the server "
        "stopped accepting connections during the replay (reported with the last message sent), and when a "
        "capture ends inside a message (that connection is replayed up to there, the others go on); 2 when the "
        "server cannot be reached at all or does not answer HELLO as a ggml RPC server (asked before anything of "
        "the captures is sent)."
    )
    p.add_argument("pcap", nargs="+", help="capture file(s), replayed in the order given")
    p.add_argument("--server", action="append", default=None, metavar="HOST:PORT",
                   help="target server (default: the embedded reference server of the captures' version, with a "
                   "fresh hash cache; one per recorded server when the captures hold several). Give it once to "
                   "send every connection to one server, or once per recorded server (in the order of their first "
                   "connection) to replay a split model's fleet, all servers at once")
    p.add_argument("--spawn", metavar="CMD", default=None,
                   help="start the target with CMD ({port}: a free port; else give --server HOST:PORT), as check "
                   "--spawn does: restarted after each death, every death reported with its signal, connection "
                   "and last message, the replay going on")
    p.add_argument("--proto", default="auto", help="version of the captures: " + proto_help(
        "auto", auto="from each HELLO reply"))
    p.add_argument("--as", dest="as_proto", default=None, metavar="VERSION",
                   help=f"({PROTO_SPELLINGS}) rewrite the session for a server of this version (cache_flag, graph "
                   "uids; refused, before anything is sent, for commands the version does not have)")
    p.add_argument("--nmse", type=float, default=DEFAULT_NMSE, help=f"tolerance for computed reads "
                   f"(default {DEFAULT_NMSE:g})")
    p.add_argument("--until-compute", action="store_true",
                   help="replay each connection only up to its first GRAPH_COMPUTE/RECOMPUTE (servers without a "
                   "graph executor)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help=f"how long to wait for any one reply (default 120; the HELLO that first asks whether the "
                   f"target is a ggml RPC server at all waits {GREETING_TIMEOUT:g} at most)")
    p.add_argument("--json", default=None, metavar="FILE|-", help="also write the report as JSON ('-': standard "
                   "output, the text report then goes to standard error)")
    p.set_defaults(func=run)


@contextlib.contextmanager
def embedded_server(protocol: Protocol) -> Iterator[tuple[str, int]]:
    """The reference server of ``protocol`` on an ephemeral loopback port, with a fresh cache directory."""
    from ggml_rpc.conformance.upstream.codebooks import tables
    from ggml_rpc.reference import running_server

    # A captured model may hold IQ weights: their codebooks come from an installed upstream peer, as for `serve`.
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-replay-cache-") as cache, \
            running_server(protocol, cache_dir=cache, codebooks=tables) as srv:
        yield srv.host, srv.port


def print_report(report: ReplayReport, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    c = report.compared
    out.write(f"replayed {report.connections} connection(s), {report.requests} request(s) "
              f"({'/'.join(report.source_versions)} as {report.target_version}) against {report.target} "
              f"in {report.seconds:.2f} s\n")
    out.write(f"compared: {c['exact']} exact, {c['computed']} computed (worst NMSE {report.worst_nmse:.3g}), "
              f"{c['close']} expected close(s); {c['recorded']} recorded only\n")
    for note in report.notes:
        out.write(f"note: {note}\n")
    for cut in report.cuts:
        out.write(f"CAPTURE CUT: {cut}\n")
    deaths = [m for m in report.mismatches if m.kind == DEATH]
    for m in report.mismatches:
        if m.kind != DEATH:
            out.write(f"MISMATCH {m.line()}\n")
    for m in deaths:
        out.write(f"DIED: {m.got}\n")
    out.write(f"{len(report.mismatches) - len(deaths)} mismatch(es)"
              + ((", and the server died" + (f" {len(deaths)} times" if len(deaths) > 1 else "")) if deaths else "")
              + (f"; {len(report.cuts)} connection(s) cut short by the capture" if report.cuts else "") + "\n")


def run(args: argparse.Namespace) -> int:

    protocol = parse_proto(args.proto)
    as_protocol = parse_proto(args.as_proto, auto=False) if args.as_proto else None
    if not args.nmse >= 0:
        raise UsageError("--nmse must be a non-negative number")
    if not args.timeout > 0:
        raise UsageError("--timeout must be positive")
    servers = [parse_address(text, "--server") for text in args.server or ()]
    if args.json:
        output_file(args.json, "--json")
    try:
        captures = load_captures(args.pcap, protocol)
        source = as_protocol or source_protocol(captures, protocol)
    except (CaptureError, ReplayError) as exc:
        raise UsageError(str(exc)) from None
    target = as_protocol or source

    def replay_to(host: str, port: int) -> ReplayReport:
        return Replayer(captures, host, port, as_protocol=as_protocol, nmse_tolerance=args.nmse,
                        timeout=args.timeout, until_compute=args.until_compute).run()

    def replay_fleet_to(targets: list[tuple[str, int]]) -> ReplayReport:
        if as_protocol is not None or args.until_compute:
            raise UsageError("a fleet replay takes neither --as nor --until-compute")
        return replay_fleet(captures, targets, free_port=free_port, nmse_tolerance=args.nmse, timeout=args.timeout)

    # A fleet is one capture holding several servers' connections (a split model); separate captures (of one
    # server each, maybe recorded on other ports) replay one after the other as always.
    fleet = max((len(recorded_servers([cap])) for cap in captures), default=1)
    if fleet > 1 and len(captures) > 1:
        raise UsageError("a capture holding several servers (a fleet) is replayed on its own: give one file")
    if args.spawn:
        if fleet > 1 or len(servers) > 1:
            raise UsageError("--spawn starts one server: a fleet (several servers) is replayed with --server")
        ready_kernels()  # a spawned `ggml-rpc serve` loads what this compiles
        return _spawned(args, captures, as_protocol, servers[0] if servers else None)
    if not servers:
        ready_kernels()  # before the embedded servers listen: no reply waits for a compile
    try:
        if len(servers) > 1:
            report = replay_fleet_to(servers)
        elif servers:
            report = replay_to(*servers[0])
        elif fleet > 1:
            with contextlib.ExitStack() as stack:
                targets = [stack.enter_context(embedded_server(target)) for _ in range(fleet)]
                report = replay_fleet_to(targets)
                report.target = f"{fleet} embedded reference servers {target.label} (" + ", ".join(
                    f"{h}:{p}" for h, p in targets) + ")"
        else:
            with embedded_server(target) as (host, port):
                report = replay_to(host, port)
                report.target = f"embedded reference server {target.label} ({host}:{port})"
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    return _finish(args, report)


def _finish(args: argparse.Namespace, report: ReplayReport) -> int:
    # With the JSON on standard output the text report moves to stderr, so the output stays one JSON document.
    print_report(report, sys.stderr if args.json == STDOUT else sys.stdout)
    if args.json:
        write_output(args.json, json.dumps(report.as_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


def _spawned(args: argparse.Namespace, captures: list[LoadedCapture], as_protocol: Protocol | None,
             address: tuple[str, int] | None) -> int:
    """``--spawn CMD``: the target started (and restarted after each death) by the replayer."""
    from ..harness import SpawnedTarget, TargetError
    from ..harness.replay_spawn import SpawnedReplayer

    target = SpawnedTarget(args.spawn)
    if address is not None:
        target.host, target.port = address
    elif "{port}" not in args.spawn:
        raise UsageError("--spawn CMD needs a {port} placeholder or --server HOST:PORT")
    try:
        target.start()
    except TargetError as exc:
        raise UsageError(str(exc)) from None
    try:
        replayer = SpawnedReplayer(captures, target, as_protocol=as_protocol, nmse_tolerance=args.nmse,
                                   timeout=args.timeout, until_compute=args.until_compute)
        report = replayer.run()
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    finally:
        target.stop()
    report.target = f"{target.description} ({target.address}; {target.restarts} restart(s))"
    return _finish(args, report)
