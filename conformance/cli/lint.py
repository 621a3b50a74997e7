"""``ggml-rpc lint FILE.pcap``: the proxy's spec checks, offline, on any capture."""

from __future__ import annotations

import argparse
import json
import sys

from ..sessions.capture import CaptureError
from ..sessions.lint import RULES, lint_file, summarize
from . import port_number


def register(sub: argparse._SubParsersAction) -> None:
    rules = "; ".join(f"{k}: {v}" for k, v in RULES.items())
    p = sub.add_parser("lint", help="check a capture against the spec's client and server rules",
                       description=f"Rules: {rules}.")
    p.add_argument("pcap", nargs="+", help="capture file(s) (pcap or pcapng)")
    p.add_argument("--proto", default="auto", help="auto (from each HELLO reply), 6, 7 or 7.0.1")
    p.add_argument("--port", type=port_number, default=None, help="only connections with this TCP port")
    p.add_argument("--json", action="store_true", help="one JSON object per violation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from . import UsageError, parse_proto

    protocol = parse_proto(args.proto)
    found = 0
    for path in args.pcap:
        try:
            violations = lint_file(path, protocol, port=args.port)
        except CaptureError as exc:
            raise UsageError(str(exc)) from None
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
