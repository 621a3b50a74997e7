"""What every sub-command shares: the usage error, option types and checks of option values.

Light on purpose: the ``ggml-rpc`` entry imports this module before it knows which command runs, so anything heavy
(the spec tables, the harness) is imported only inside the function that needs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ggml_rpc.spec import Protocol


class UsageError(Exception):
    """A mistake of the user's (bad option, missing file, unreachable server): one line, exit code 2."""


def port_number(text: str) -> int:
    """The argparse type of a TCP port option: 1..65535."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}")
    return int(text)


#: ``-`` in place of an output file: standard output, in every command.
STDOUT = "-"

#: The ``--proto`` spellings every command accepts (:func:`parse_proto`), for its help text.
PROTO_SPELLINGS = "6, 7, 7.0.1 or 8 (or in full: 6.0.0, 7.0, 8.0.0)"


def proto_help(default: str | None, *, auto: str | None = None, every: str | None = None) -> str:
    """The help of a ``--proto`` option, the same words in every command: what ``auto``/``all`` mean there (when
    the command takes them) and the default."""
    extra = [f"auto ({auto})" if auto else "", f"all ({every})" if every else ""]
    head = ", ".join(x for x in extra if x)
    return (f"{head + ', ' if head else ''}{PROTO_SPELLINGS}"
            + (f" (default {default})" if default else ""))


def parse_proto(text: str, *, auto: bool = True) -> Protocol | None:
    """A ``--proto`` value: None for ``auto`` (when the command accepts it), else the version's table."""
    from ggml_rpc.spec import parse_version_option

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
    """An output file option, checked before any work is done: its folder must exist and it must not be one
    (``-`` is standard output)."""
    if path == STDOUT:
        return path
    if option == "--json" and Path(path).suffix.lower() in (".pcap", ".pcapng", ".cap"):
        # ``--json`` takes a FILE: the old flag spelling (``lint --json a.pcap b.pcap``) must not overwrite a capture.
        raise UsageError(f"--json {path}: that is a capture; --json takes an output FILE or - (standard output)")
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if not target.parent.is_dir():
        raise UsageError(f"{option} {path}: no such directory {str(target.parent)!r}")
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        raise UsageError(f"{option} {path}: not writable")
    return path


def output_dir(path: str, option: str) -> str:
    """An output folder option, checked before any work is done: a folder, or one that can be made where it is
    named (its nearest existing parent is a writable folder)."""
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise UsageError(f"{option} {path}: exists and is not a directory")
        if not os.access(target, os.W_OK):
            raise UsageError(f"{option} {path}: not writable")
        return path
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: cannot be created in {str(parent)!r} (not writable)")
    return path


def one_stdout(**options: str | None) -> bool:
    """Refuse two outputs to standard output (they would interleave); True when one goes there, so the command
    moves its text report to standard error and standard output stays one document."""
    on_stdout = [f"--{name.replace('_', '-')}" for name, value in options.items() if value == STDOUT]
    if len(on_stdout) > 1:
        raise UsageError(f"{' and '.join(on_stdout)} both name standard output (-): give at most one of them -")
    return bool(on_stdout)


def write_output(path: str, text: str) -> None:
    """Write an output file, or standard output for ``-``; a failure is a usage error naming the file."""
    if path == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def os_reason(exc: OSError) -> str:
    """Why a system call failed, without the bind address socket.create_server appends to the reason."""
    return (exc.strerror or str(exc)).split(" (while attempting to bind", 1)[0]
