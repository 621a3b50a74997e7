"""``ggml-rpc dissector -o ggml_rpc.lua``: write the Wireshark Lua dissector generated from the spec tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ggml_rpc.spec.facts import DEFAULT_PORT
from ggml_rpc.spec.render.lua_source import generate

from .options import UsageError, port_number


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", default="-", help="file to write (default: standard output)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT,
                   help=f"TCP port to register on (default: {DEFAULT_PORT})")
    p.add_argument("--reassemble-bulk", action="store_true",
                   help="let Wireshark reassemble whole SET_TENSOR/GET_TENSOR messages (holds the largest in memory) "
                   "instead of counting bulk bytes segment by segment")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    source = generate(port=args.port, reassemble_bulk=args.reassemble_bulk)
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
