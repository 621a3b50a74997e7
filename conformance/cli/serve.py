"""``ggml-rpc serve``: run the reference server in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from dataclasses import replace

from ggml_rpc.spec import DEFAULT_HOST, DEFAULT_PORT

from ..harness import format_address
from .options import UsageError, os_reason, parse_proto, proto_help

#: Microseconds a served connection polls for its next request before sleeping (reference/config.py says why).
DEFAULT_POLL_US = 200

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``4096``, ``512M``, ``4G``, ``1TiB`` (binary units) -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 512M, 4G)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run the reference ggml RPC server: every command of the protocol version --proto names, with upstream "
        "semantics; where upstream aborts or is unsafe it closes only the offending connection and logs the rule."
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free)")
    p.add_argument("--proto", default="7", help="protocol version: " + proto_help("7"))
    p.add_argument("--cache-dir", help="hash cache directory (default: no cache)")
    p.add_argument("--cache-max-bytes", help="bound the cache directory (least recently used entries go first)")
    p.add_argument("--devices", type=int, default=1, help="number of devices (default 1)")
    p.add_argument("--mem", default="4G", help="memory budget per device (default 4G)")
    p.add_argument("--alignment", type=int, default=None, help="GET_ALIGNMENT answer (default 32, as upstream CPU)")
    p.add_argument("--max-size", default=None, help="GET_MAX_SIZE answer (default 2^64-1, as upstream CPU)")
    p.add_argument("--concurrent", action="store_true", help="serve many connections at once (upstream: one)")
    p.add_argument("--poll-us", type=int, default=DEFAULT_POLL_US, metavar="US",
                   help=f"keep reading a connection's socket this many microseconds for its next request before "
                        f"sleeping (default {DEFAULT_POLL_US}; 0: sleep at once): a sleeping server is woken "
                        f"through its CPU, which costs tens of microseconds per request on virtual machines")
    p.add_argument("--no-preload", dest="preload", action="store_false",
                   help="do not make the executor's compiled kernels ready before listening (by default they are: "
                        "loaded from numba's cache in a second or two, or compiled on this machine's first run, so "
                        "that no client's first graph waits for a compile)")
    p.add_argument("--verbose", action="store_true", help="log one line per command")
    p.add_argument("--list-ops", action="store_true", help="print the ops x types the executor computes, and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ggml_rpc.reference import Server, make_config, warm_up

    if args.list_ops:
        from ggml_rpc.conformance.upstream.ops_table import render_ops_table

        sys.stdout.write(render_ops_table())
        return 0
    protocol = parse_proto(args.proto, auto=False)
    try:
        mem = parse_size(args.mem)
        cache_max = parse_size(args.cache_max_bytes) if args.cache_max_bytes else None
        max_size = parse_size(args.max_size) if args.max_size else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.devices < 1:
        raise UsageError("--devices must be at least 1")
    if not 0 <= args.poll_us <= 1_000_000:
        raise UsageError("--poll-us must be 0..1000000")
    if args.alignment is not None and (args.alignment < 1 or args.alignment & (args.alignment - 1)):
        raise UsageError("--alignment must be a power of two")
    if not 0 <= args.port <= 65535:
        raise UsageError("--port must be 0..65535")
    if max_size is not None and max_size >= 1 << 64:
        raise UsageError("--max-size must fit in 64 bits")
    if args.cache_dir and os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(f"--cache-dir {args.cache_dir}: not a directory")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    from ggml_rpc.conformance.upstream.codebooks import tables

    # The IQ codebooks come from an installed upstream peer, when there is one (the reference holds no upstream data).
    config = make_config(protocol, devices=args.devices, mem=mem, alignment=args.alignment, max_size=max_size,
                         cache_dir=args.cache_dir, cache_max_bytes=cache_max, concurrent=args.concurrent,
                         verbose=args.verbose, codebooks=tables, poll_us=args.poll_us)
    ready = warm_up(lambda: logging.info("compiling the executor's kernels for this machine before listening "
                                         "(first run only, a minute or two; later runs load them from numba's "
                                         "cache)")) if args.preload else None
    if not args.preload:
        config = replace(config, warm_up=False)
    try:
        server = Server(config, args.host, args.port)
    except OSError as exc:
        if exc.filename is not None:  # the cache directory
            raise UsageError(f"--cache-dir {args.cache_dir}: {os_reason(exc)}") from None
        raise UsageError(f"cannot listen on {format_address(args.host, args.port)}: {os_reason(exc)}") from None
    print(f"ggml-rpc serve: protocol {protocol.label} listening on {format_address(args.host, server.port)}",
          file=sys.stderr, flush=True)
    try:
        # Inside the try: a signal right after the listening line must still stop the server's threads.
        if ready:  # logged after the listening line, which scripts read first
            logging.info("%s", ready)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
