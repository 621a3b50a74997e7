"""What every sub-command shares: the usage error, option types and checks of option values.

Light on purpose: the ``ggml-rpc`` entry imports this module before it knows which command runs, so anything heavy
(the spec tables, the harness) is imported only inside the function that needs it.
"""

from __future__ import annotations

import argparse
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
