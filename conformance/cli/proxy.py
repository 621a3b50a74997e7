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
        "Forwards every connection made to --listen to --upstream (several pairs: a fleet), decoding both "
        "directions on the way; -o/--output records what passed, --check reports spec violations of "
        "either side as they happen (the rules of `ggml-rpc lint`)."
    )
    p.add_argument("--listen", action="append", default=None, metavar="HOST:PORT",
                   help="address to listen on (port 0: any free port, printed at start; default 127.0.0.1:50053); "
                   "with several --upstream, one --listen each (or one with port 0 for all)")
    p.add_argument("--upstream", action="append", required=True, metavar="HOST:PORT",
                   help="the real server; repeat it to front a fleet (a split model): one listening port per "
                   "server, one recording, one report")
    p.add_argument("-o", "--output", "--pcap", dest="pcap", default=None, metavar="FILE",
                   help="write what passed as a pcap file (--pcap: the older spelling, kept as an alias)")
    p.add_argument("--check", action="store_true", help="report spec violations as they happen")
    p.add_argument("--mss", type=int, default=None, help="segment size of the recorded TCP packets")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    upstreams = [parse_address(text, "--upstream") for text in args.upstream]
    listens = [parse_address(text, "--listen", any_port=True) for text in args.listen or ["127.0.0.1:50053"]]
    if len(upstreams) > 1 and not args.listen:
        listens = [("127.0.0.1", 0)]
    if len(listens) != len(upstreams) and not (len(listens) == 1 and listens[0][1] == 0):
        raise UsageError(f"{len(upstreams)} --upstream need as many --listen (or one with port 0): "
                         f"{len(listens)} given")
    if args.mss is not None and not 1 <= args.mss <= MAX_MSS:
        raise UsageError(f"--mss must be 1..{MAX_MSS}")
    if args.pcap == "-":
        # Standard output carries the banner, the VIOLATION lines and the summary: a pcap cannot share it.
        raise UsageError("--output -: the proxy prints its report on standard output; give the pcap a FILE")
    if args.pcap:
        output_file(args.pcap, "--output")

    def show(v: Violation) -> None:
        print(f"VIOLATION {v.line()}", file=sys.stdout, flush=True)

    try:
        proxy = Proxy(upstreams, listens, pcap=args.pcap, check=args.check, on_violation=show, mss=args.mss)
    except OSError as exc:
        if exc.filename is not None:  # the pcap could not be created
            raise UsageError(f"cannot write {exc.filename}: {os_reason(exc)}") from None
        where = ", ".join(format_address(*at) for at in listens)
        raise UsageError(f"cannot listen on {where}: {os_reason(exc)}") from None
    fronts = ", ".join(f"{format_address(*at)} -> {format_address(*up)}"
                       for at, up in zip(proxy.addresses, upstreams, strict=True))
    print(f"ggml-rpc proxy: {fronts}"
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
