"""``ggml-rpc spec``: the Markdown protocol reference generated from the schemas."""

from __future__ import annotations

import argparse
import sys

from ggml_rpc.spec.render.markdown import render_markdown

from .options import parse_proto, proto_help


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proto", default=None, help="only this version: " + proto_help(None) + "; default: all")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    versions = [parse_proto(args.proto, auto=False)] if args.proto else None
    sys.stdout.write(render_markdown(versions))
    return 0
