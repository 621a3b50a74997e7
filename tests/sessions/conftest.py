"""Helpers shared by the session tests: synthetic sessions as ordered writes, tshark."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from ggml_rpc.spec import (
    CONN_CAPS_SIZE,
    V6,
    V7,
    Command,
    Protocol,
    encode_reply,
    encode_request,
    fnv1a64,
    hello_reply,
    make_tensor,
)

HELLO_REQ = {"conn_caps": bytes(CONN_CAPS_SIZE)}


def hello(protocol: Protocol) -> list[tuple[bool, bytes]]:
    return [(True, encode_request(protocol, Command.HELLO, HELLO_REQ)),
            (False, encode_reply(protocol, Command.HELLO, hello_reply(protocol.version)))]


def weight(data: bytes, *, buffer: int = 0x1000, base: int = 0x7000_0000) -> dict:
    return make_tensor(id=0xAA, type=0, ne=(len(data) // 4,), buffer=buffer, data=base, name="w")


def hash_then_set(protocol: Protocol, data: bytes, *, flag: int = 1, hashed: bytes | None = None,
                  hit: bool = False) -> list[tuple[bool, bytes]]:
    """SET_TENSOR_HASH (miss unless ``hit``) then, on a miss, SET_TENSOR with ``flag`` (v7 layout only)."""
    t = weight(data)
    digest = fnv1a64(hashed if hashed is not None else data)
    out = [(True, encode_request(protocol, Command.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": digest})),
           (False, encode_reply(protocol, Command.SET_TENSOR_HASH, {"result": int(hit)}))]
    if not hit:
        fields = {"tensor": t, "offset": 0}
        if protocol is V7:
            fields["cache_flag"] = flag
        out.append((True, encode_request(protocol, Command.SET_TENSOR, fields, data)))
    return out


def tshark_problems(path: Path) -> str:
    """Packets tshark marks as malformed, with TCP analysis flags or bad checksums, plus expert warnings/errors
    ('' if none)."""
    exe = shutil.which("tshark")
    if exe is None:
        pytest.skip("tshark is not installed (.ci/run installs it)")
    checks = ["-o", "tcp.check_checksum:TRUE", "-o", "ip.check_checksum:TRUE"]
    flagged = subprocess.run([exe, "-n", *checks, "-r", str(path), "-Y",
                              "tcp.analysis.flags || _ws.malformed || tcp.checksum.status == 0 || "
                              "ip.checksum.status == 0"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    expert = subprocess.run([exe, "-n", "-r", str(path), "-q", "-z", "expert,warn"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    warn = [line for line in expert.splitlines() if line.strip().startswith(("Errors", "Warns", "Warnings"))]
    return flagged.strip() + "\n".join(warn)


__all__ = ["V6", "V7", "hash_then_set", "hello", "tshark_problems", "weight"]
