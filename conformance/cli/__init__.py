"""The ``ggml-rpc`` command line: one sub-command per module ``ggml_rpc.conformance.cli.<name>``.

Each such module defines ``register(subparsers)`` (adding its parser, with ``func`` set to a callable taking the
parsed arguments and returning an exit code).  User mistakes raise :class:`UsageError` and end with one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ggml_rpc.spec import Protocol, parse_version_option

#: Sub-commands, in the order ``--help`` lists them.
COMMANDS = ("check", "decode", "spec", "serve", "lint", "replay", "dissector", "proxy", "pcap", "bench", "fuzz",
            "upstream", "interop")


class UsageError(Exception):
    """A mistake of the user's (bad option, missing file, unreachable server): one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def port_number(text: str) -> int:
    """The argparse type of a TCP port option: 1..65535."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}")
    return int(text)


def parse_proto(text: str, *, auto: bool = True) -> Protocol | None:
    """A ``--proto`` value: None for ``auto`` (when the command accepts it), else the version's table."""
    if auto and text == "auto":
        return None
    try:
        return parse_version_option(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def parse_address(text: str, option: str, *, any_port: bool = False) -> tuple[str, int]:
    """A ``HOST:PORT`` option value (``[::1]:PORT`` for IPv6; port 0 only with ``any_port``) as a tuple."""
    from ..harness import parse_address as parse

    try:
        return parse(text, any_port=any_port)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def output_file(path: str, option: str) -> str:
    """An output file option, checked before any work is done: its folder must exist and it must not be one."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if not target.parent.is_dir():
        raise UsageError(f"{option} {path}: no such directory {str(target.parent)!r}")
    return path


def os_reason(exc: OSError) -> str:
    """Why a system call failed, without the bind address socket.create_server appends to the reason."""
    return (exc.strerror or str(exc)).split(" (while attempting to bind", 1)[0]


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM stops a command the way Ctrl-C does, so servers and spawned targets are shut down and pcaps completed.
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ggml-rpc",
        description="Specification, reference server and conformance kit for the ggml RPC protocol.",
    )
    from ..harness.report_files import kit_version

    parser.add_argument("--version", action="version", version=f"ggml-rpc-kit {kit_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.exit(2, f"ggml-rpc {args.command}: error: unrecognized arguments: {' '.join(extra)} "
                       f"(see ggml-rpc {args.command} --help)\n")
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"ggml-rpc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ggml-rpc {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
