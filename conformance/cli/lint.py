"""``ggml-rpc lint FILE.pcap``: the proxy's spec checks, offline, on any capture."""

from __future__ import annotations

import argparse
import json
import sys

from ..sessions.capture import CaptureError, read_connections
from ..sessions.lint import RULES, lint_connections, summarize
from .options import STDOUT, UsageError, output_file, parse_proto, port_number, proto_help, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    rules = "; ".join(f"{k}: {v}" for k, v in RULES.items())
    p.description = f"Rules: {rules}."
    p.add_argument("pcap", nargs="+", help="capture file(s) (pcap or pcapng)")
    p.add_argument("--proto", default="auto", help=proto_help("auto", auto="from each HELLO reply"))
    p.add_argument("--port", type=port_number, default=None, help="only connections with this TCP port")
    p.add_argument("--json", metavar="FILE|-", default=None, help="also write one JSON object per violation (JSON "
                   "lines) to FILE; '-': on standard output, instead of the text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    protocol = parse_proto(args.proto)
    if args.json is not None:
        output_file(args.json, "--json")
    text = args.json != STDOUT  # the text report, unless the JSON lines take standard output
    lines: list[str] = []
    found = 0
    for path in args.pcap:
        try:
            conns = read_connections(path, port=args.port)
        except CaptureError as exc:
            raise UsageError(str(exc)) from None
        if not conns:
            # Nothing was checked: not a clean capture.
            where = f" with port {args.port}" if args.port is not None else ""
            raise UsageError(f"no TCP connection{where} in {path}")
        violations = lint_connections(conns, protocol)
        found += len(violations)
        for v in violations:
            lines.append(json.dumps({"file": str(path), **v.as_dict()}) + "\n")
            if text:
                sys.stdout.write(f"{path}: {v.line()}\n")
        if text:
            counts = summarize(violations)
            detail = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
            sys.stdout.write(f"{path}: {len(violations)} violation(s){': ' + detail if detail else ''}\n")
    if args.json is not None:
        write_output(args.json, "".join(lines))
    return 1 if found else 0
