"""``ggml-rpc lint FILE.pcap``: the proxy's spec checks, offline, on any capture."""

from __future__ import annotations

import argparse
import json
import sys

from ..sessions.capture import CaptureError, read_connections
from ..sessions.lint import RULES, lint_connections, summarize
from .options import UsageError, parse_proto, port_number


def add_arguments(p: argparse.ArgumentParser) -> None:
    rules = "; ".join(f"{k}: {v}" for k, v in RULES.items())
    p.description = f"Rules: {rules}."
    p.add_argument("pcap", nargs="+", help="capture file(s) (pcap or pcapng)")
    p.add_argument("--proto", default="auto", help="auto (from each HELLO reply), 6, 7 or 7.0.1")
    p.add_argument("--port", type=port_number, default=None, help="only connections with this TCP port")
    p.add_argument("--json", action="store_true", help="one JSON object per violation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    protocol = parse_proto(args.proto)
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
            if args.json:
                sys.stdout.write(json.dumps({"file": str(path), **v.as_dict()}) + "\n")
            else:
                sys.stdout.write(f"{path}: {v.line()}\n")
        if not args.json:
            counts = summarize(violations)
            detail = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
            sys.stdout.write(f"{path}: {len(violations)} violation(s){': ' + detail if detail else ''}\n")
    return 1 if found else 0
