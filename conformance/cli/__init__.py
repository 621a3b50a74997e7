"""The ``ggml-rpc`` command line.

Each sub-command lives in a module of this package named after it (``ggml-rpc check`` in :mod:`.check`), which
defines ``add_arguments(parser)``: the command's description and options, with ``func`` set to a callable taking
the parsed arguments and returning an exit code.  :data:`COMMANDS` lists every command with its one-line help, so
``ggml-rpc --help`` names them all without importing any; only the module of the command given on the command line
is imported (and its parser built).  User mistakes raise :class:`~.options.UsageError` and end with one line on
stderr and exit code 2, never a traceback.  A reader that closes standard output early (``ggml-rpc check | head``)
is not an error: exit code 0.  SIGINT and SIGTERM stop every command the same way, with exit code 130
(see :mod:`.interrupts`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn

from . import interrupts
from .options import UsageError

#: Sub-commands, in the order ``--help`` lists them, with the one-line help it shows; the parser of ``NAME`` is
#: built by ``ggml_rpc.conformance.cli.NAME.add_arguments``.
COMMANDS: dict[str, str] = {
    "check": "run the conformance suite against a server (default: the embedded reference server)",
    "decode": "decode a pcap of ggml RPC traffic, one line per message",
    "spec": "print the protocol reference generated from the schemas (Markdown)",
    "serve": "run the reference server",
    "lint": "check a capture against the spec's client and server rules",
    "replay": "replay captured sessions against a server and compare the replies",
    "dissector": "generate the Wireshark/tshark Lua dissector from the spec",
    "proxy": "transparent recording proxy between a client and a server",
    "pcap": "record named client sessions as pcap files",
    "bench": "measure the reference server, any other server and the kit, side by side",
    "fuzz": "fuzz a server against the reference server's logic; save shrunk reproducers",
    "upstream": "build and list genuine upstream llama.cpp peers (rpc-server, llama-completion, test-backend-ops)",
    "interop": "run the interop matrix against the installed upstream peers",
}


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """``--version``, with the version looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the kit's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: object, values: object,
                 option_string: str | None = None) -> NoReturn:
        from .. import kit_version

        sys.stdout.write(f"ggml-rpc-kit {kit_version()}\n")
        parser.exit()


def build_parser(commands: Iterable[str] = ()) -> argparse.ArgumentParser:
    """The ``ggml-rpc`` parser: every command listed, the options of those in ``commands`` (their modules imported)."""
    parser = _Parser(
        prog="ggml-rpc",
        description="Specification, reference server and conformance kit for the ggml RPC protocol.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = set(commands)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name in chosen:
            importlib.import_module(f"{__name__}.{name}").add_arguments(p)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The command an argument list names: its first argument that is not an option (the top level takes none
    with a value)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def _discard_stdout() -> None:
    """Standard output's reader is gone: send what is still buffered, and anything written later, to /dev/null
    (else the interpreter's last flush at exit fails again)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # standard output is not a file descriptor (captured, closed)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except BrokenPipeError:
        _discard_stdout()
        return 0
    finally:
        # A pipe closed by its reader shows here at the latest (``--help | head -1``, or output still buffered).
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _discard_stdout()
        except (OSError, ValueError):
            pass


def _run(argv: list[str]) -> int:
    command = _command_in(argv)
    parser = build_parser([command] if command else [])
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.exit(2, f"ggml-rpc {args.command}: error: unrecognized arguments: {' '.join(extra)} "
                       f"(see ggml-rpc {args.command} --help)\n")
    with interrupts.handling():
        code: int | None = None
        try:
            code = int(args.func(args) or 0)
            sys.stdout.flush()
        except UsageError as exc:
            if interrupts.interrupted() is None:
                print(f"ggml-rpc {args.command}: error: {exc}", file=sys.stderr)
                return 2
        except KeyboardInterrupt:
            pass
        signum = interrupts.interrupted()
        if code is None or signum is not None:
            # Whatever the command concluded after being told to stop, the run did not finish: one code.  (A
            # KeyboardInterrupt without a signal comes from an embedding caller: an interrupt all the same.)
            name = interrupts.signal_name(signum) if signum is not None else "SIGINT"
            print(f"ggml-rpc {args.command}: interrupted ({name})", file=sys.stderr)
            return interrupts.EXIT_INTERRUPTED
        return code
