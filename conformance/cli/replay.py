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

from ..sessions.capture import CaptureError
from ..sessions.compare import DEFAULT_NMSE, ReplayReport
from ..sessions.replay import Replayer, ReplayError, load_captures, source_protocol
from .options import UsageError, output_file, parse_address, parse_proto


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Replays the client side of every connection of the captures, in order, against "
        "one server, relocating buffer handles and addresses, and compares each reply by class "
        "(exact, recorded, computed within an NMSE tolerance). Exit code 1 on any mismatch."
    )
    p.add_argument("pcap", nargs="+", help="capture file(s), replayed in the order given")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="target server (default: the embedded reference server of the captures' version, with a "
                   "fresh hash cache)")
    p.add_argument("--proto", default="auto", help="version of the captures: auto (from each HELLO reply), 6 or 7")
    p.add_argument("--as", dest="as_proto", default=None, choices=["6", "7"],
                   help="rewrite the session for a server of this version")
    p.add_argument("--nmse", type=float, default=DEFAULT_NMSE, help=f"tolerance for computed reads "
                   f"(default {DEFAULT_NMSE:g})")
    p.add_argument("--until-compute", action="store_true",
                   help="replay each connection only up to its first GRAPH_COMPUTE/RECOMPUTE (servers without a "
                   "graph executor)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one reply")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON ('-': standard "
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
    for m in report.mismatches:
        out.write(f"MISMATCH {m.line()}\n")
    out.write(f"{len(report.mismatches)} mismatch(es)\n")


def run(args: argparse.Namespace) -> int:

    protocol = parse_proto(args.proto)
    as_protocol = parse_proto(args.as_proto, auto=False) if args.as_proto else None
    if not args.nmse >= 0:
        raise UsageError("--nmse must be a non-negative number")
    if not args.timeout > 0:
        raise UsageError("--timeout must be positive")
    server = parse_address(args.server, "--server") if args.server else None
    if args.json and args.json != "-":
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

    try:
        if server is not None:
            report = replay_to(*server)
        else:
            with embedded_server(target) as (host, port):
                report = replay_to(host, port)
                report.target = f"embedded reference server {target.label} ({host}:{port})"
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    # With the JSON on standard output the text report moves to stderr, so the output stays one JSON document.
    print_report(report, sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        text = json.dumps(report.as_dict(), indent=2)
        if args.json == "-":
            sys.stdout.write(text + "\n")
        else:
            try:
                with open(args.json, "w") as fh:
                    fh.write(text + "\n")
            except OSError as exc:
                raise UsageError(f"cannot write {args.json}: {exc.strerror or exc}") from None
    return 0 if report.ok else 1
