"""``ggml-rpc proxy --listen HOST:PORT --upstream HOST:PORT``: forward, record a pcap, check both sides live."""

from __future__ import annotations

import argparse
import sys
import threading

from ..harness import format_address
from ..sessions.lint import Violation
from ..sessions.pcapwrite import MAX_MSS
from ..sessions.proxy import Proxy
from .options import UsageError, os_reason, output_file, parse_address


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Forwards every connection made to --listen to --upstream, decoding both "
        "directions on the way; --pcap records what passed, --check reports spec violations of "
        "either side as they happen (the rules of `ggml-rpc lint`)."
    )
    p.add_argument("--listen", default="127.0.0.1:50053", metavar="HOST:PORT",
                   help="address to listen on (port 0: any free port, printed at start)")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the real server")
    p.add_argument("--pcap", default=None, metavar="OUT", help="write what passed as a pcap file")
    p.add_argument("--check", action="store_true", help="report spec violations as they happen")
    p.add_argument("--mss", type=int, default=None, help="segment size of the recorded TCP packets")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    listen = parse_address(args.listen, "--listen", any_port=True)
    upstream = parse_address(args.upstream, "--upstream")
    if args.mss is not None and not 1 <= args.mss <= MAX_MSS:
        raise UsageError(f"--mss must be 1..{MAX_MSS}")
    if args.pcap:
        output_file(args.pcap, "--pcap")

    def show(v: Violation) -> None:
        print(f"VIOLATION {v.line()}", file=sys.stdout, flush=True)

    try:
        proxy = Proxy(upstream, listen, pcap=args.pcap, check=args.check, on_violation=show, mss=args.mss)
    except OSError as exc:
        if exc.filename is not None:  # the pcap could not be created
            raise UsageError(f"cannot write {exc.filename}: {os_reason(exc)}") from None
        raise UsageError(f"cannot listen on {args.listen}: {os_reason(exc)}") from None
    print(f"ggml-rpc proxy: {format_address(proxy.host, proxy.port)} -> {format_address(*upstream)}"
          f"{' recording ' + args.pcap if args.pcap else ''}{' checking' if args.check else ''}", flush=True)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    s = proxy.stats
    print(f"ggml-rpc proxy: {s.connections} connection(s), {s.requests} request(s), {s.replies} reply(ies), "
          f"{s.bytes_c2s} bytes up, {s.bytes_s2c} bytes down, {len(s.violations)} violation(s)", flush=True)
    return 1 if args.check and s.violations else 0
