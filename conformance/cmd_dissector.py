"""``ggml-rpc dissector -o ggml_rpc.lua``: write the Wireshark Lua dissector generated from the spec tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .dissector import generate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dissector", help="generate the Wireshark/tshark Lua dissector from the spec")
    p.add_argument("-o", "--output", default="-", help="file to write (default: standard output)")
    p.add_argument("--port", type=int, default=None, help="TCP port to register on (default: 50052)")
    p.add_argument("--reassemble-bulk", action="store_true",
                   help="let Wireshark reassemble whole SET_TENSOR/GET_TENSOR messages (holds the largest in memory) "
                   "instead of counting bulk bytes segment by segment")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .cli import UsageError

    kwargs: dict = {"reassemble_bulk": args.reassemble_bulk}
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise UsageError(f"--port {args.port} is not a TCP port (1-65535)")
        kwargs["port"] = args.port
    source = generate(**kwargs)
    if args.output == "-":
        sys.stdout.write(source)
        return 0
    out = Path(args.output)
    try:
        out.write_text(source, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"wrote {out} ({len(source.splitlines())} lines)", file=sys.stderr)
    return 0
