"""Upstream ``test-backend-ops`` against any RPC server, through the kit's interposer (``interpose.c``).

The interposer is compiled at install time against the peer's own libraries; preloaded, it registers the RPC
servers named in ``GGML_RPC_KIT_SERVERS`` when the program loads its backends, so the program, unmodified, tests
device ``RPC0``: the kit's reference server or upstream's own.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .peers import Peer

_SOURCE = "interpose.c"


class InterposerError(Exception):
    """The interposer could not be built (the message names what is missing)."""


def build_interposer(peer: Peer, *, force: bool = False) -> Path:
    """Compile the interposer into ``peer.interposer`` (only when missing or older than its source)."""
    source = Path(str(resources.files("ggml_rpc.conformance.upstream").joinpath(_SOURCE)))
    out = peer.interposer
    if out.is_file() and not force and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise InterposerError("no C compiler: apt-get install gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".so.tmp")
    # It resolves upstream's symbols at run time (dlsym), so it needs no upstream header or library to link.
    p = subprocess.run([cc, "-O2", "-fPIC", "-shared", "-Wall", "-o", str(tmp), str(source), "-ldl"],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise InterposerError(f"compiling the interposer failed: {p.stderr.strip()[:300]}")
    tmp.rename(out)
    return out


def backend_ops_env(peer: Peer, servers: list[str]) -> dict[str, str]:
    """The environment that makes ``servers`` appear as RPC0, RPC1, ... in the peer's programs."""
    return peer.env({"LD_PRELOAD": str(build_interposer(peer)), "GGML_RPC_KIT_SERVERS": ",".join(servers)})


_CASE = re.compile(r"^\s*(?P<op>[A-Z_0-9]+)\((?P<params>.*)\):\s*(?P<rest>.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SUMMARY = re.compile(r"^\s*(\d+)/(\d+) tests passed")


@dataclass
class BackendOpsResult:
    """One run of ``test-backend-ops test`` on device RPC0: per op, cases passed / run / not supported."""

    passed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    unsupported: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    summary: tuple[int, int] | None = None
    exit_code: int | None = None
    seconds: float = 0.0
    stderr_tail: str = ""
    #: Each case's name (``OP(params)``, as printed) -> how many times it passed: OPS rows compare these by name.
    ok_cases: Counter[str] = field(default_factory=Counter)

    @property
    def aborted(self) -> bool:
        """The program did not finish (the upstream client aborts when a server closes): its counts are partial."""
        return self.exit_code is None or self.exit_code < 0 or self.summary is None

    def total(self, op: str) -> int:
        return self.passed.get(op, 0) + self.failed.get(op, 0)


def parse_backend_ops(text: str) -> BackendOpsResult:
    """Count the per-case lines test-backend-ops prints (``OP(params): OK`` / ``FAIL`` / ``not supported``)."""
    res = BackendOpsResult()
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        m = _SUMMARY.match(line)
        if m:
            res.summary = (int(m.group(1)), int(m.group(2)))
            continue
        m = _CASE.match(line)
        if not m:
            continue
        op, rest = m.group("op"), m.group("rest")
        if rest.startswith("not supported"):
            res.unsupported[op] = res.unsupported.get(op, 0) + 1
        elif rest.rstrip().endswith("OK"):
            res.passed[op] = res.passed.get(op, 0) + 1
            res.ok_cases[f"{op}({m.group('params')})"] += 1
        elif "FAIL" in rest:
            res.failed[op] = res.failed.get(op, 0) + 1
            if len(res.failures) < 20:
                res.failures.append(line.strip()[:200])
    return res


def run_backend_ops(peer: Peer, server: str, op: str | None, *, timeout: float = 600.0,
                    params: str | None = None) -> BackendOpsResult:
    """``test-backend-ops test -b RPC0 [-o OP] [-p PARAMS]`` with ``server`` as RPC0 (``params``: a regular
    expression the cases' parameter strings must match, test-backend-ops' own filter)."""
    import time

    argv = [str(peer.test_backend_ops), "test", "-b", "RPC0"] + (["-o", op] if op else []) + \
        (["-p", params] if params else [])
    started = time.monotonic()
    try:
        p = subprocess.run(argv, env=backend_ops_env(peer, [server]), stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=timeout)
        out, err, code = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = exc.stdout or b"", exc.stderr or b"", None
    res = parse_backend_ops(out.decode("utf-8", "replace"))
    res.exit_code = code
    res.seconds = time.monotonic() - started
    res.stderr_tail = " | ".join(err.decode("utf-8", "replace").strip().splitlines()[-3:])[:300]
    return res
