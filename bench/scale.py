"""Sessions of real size, the steps of ``bench/bench_scale.py``: record a genuine session through the checking proxy,
measure the kit's tools on the capture beside tshark, and time generation through the reference server and
upstream's.

Every process is started on 127.0.0.1 and bounded by a time limit; upstream servers and clients get a temporary
``LLAMA_CACHE``.  Peak resident memory of a server or of the proxy is its own (``wait4`` of that process, which must
therefore be a direct child: nothing else may reap it); of a tool, that of the only child of a wrapper
(:func:`.large_capture.measure`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_rpc.conformance.harness import free_port, wait_for_port
from ggml_rpc.conformance.upstream.peers import LOOPBACK, Peer
from ggml_rpc.conformance.upstream.runs import Finished, completion_argv, generated_text, run

from .large_capture import measure
from .scale_report import summarise_generation, summarise_runs

#: The prompt of every generation: under twenty tokens, so that the prompt figure is more than one token's and the
#: largest model's prompt stays within minutes on the reference server.
PROMPT = "Once upon a time, in a small village at the edge of a forest, there lived"

#: The kit's command line, as a user runs it (the same interpreter and checkout as this script).
KIT = [sys.executable, "-m", "ggml_rpc.conformance.cli"]

#: Budget the reference server announces: the largest model's weights, cache and compute buffers fit with room.
REFERENCE_MEM = "16G"

#: llama-completion's timing lines, e.g. ``prompt eval time = 12.34 ms / 5 tokens ( 2.47 ms per token, 405.19 tokens
#: per second)`` and ``eval time = 144.32 ms / 63 runs ( 2.29 ms per token, 436.52 tokens per second)``.
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens\s*\(\s*([\d.]+) ms per token,\s*"
                          r"([\d.]+) tokens per second\)")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs\s*\(\s*([\d.]+) ms per token,\s*"
                   r"([\d.]+) tokens per second\)")
_BANNER = re.compile(r"ggml-rpc proxy: \S+:(\d+) ->")
_SUMMARY = re.compile(r"(\d+) violation\(s\)")


def speeds(stderr: str) -> dict[str, float | int | None]:
    """The prompt and generation speeds llama-completion printed last (None where it printed none)."""
    prompt, gen = _PROMPT_EVAL.findall(stderr), _EVAL.findall(stderr)
    return {"prompt_tokens": int(prompt[-1][1]) if prompt else None,
            "prompt_tps": float(prompt[-1][3]) if prompt else None,
            "eval_tokens": int(gen[-1][1]) if gen else None,
            "eval_tps": float(gen[-1][3]) if gen else None}


def vm_hwm_kib(pid: int) -> int | None:
    """The peak resident set (``VmHWM``, KiB) of a running process, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 60.0) -> tuple[int | None, int]:
    """Stop a direct child with ``sig`` (SIGKILL after ``timeout`` s) and reap it: (exit code, peak RSS in KiB)."""
    before = vm_hwm_kib(proc.pid) or 0
    if proc.returncode is not None:  # already reaped by someone else: only what /proc said is known
        return proc.returncode, before
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)  # SIGKILL cannot be ignored: this returns
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    # VmHWM while it ran, not the reaped child's ru_maxrss: Linux carries the peak of the memory a process had
    # before exec into its maxrss, and that is a copy of this parent's (4.9 GB while the 4 GB model was being
    # written, reported as both servers' peak). ru_maxrss only for a child already gone.
    return proc.returncode, before or int(usage.ru_maxrss)


@dataclass
class Served:
    """A server started by :func:`serve`: its address; once stopped, its exit code and peak RSS."""

    address: str
    pid: int
    rc: int | None = None
    peak_kib: int | None = None
    log_tail: str = ""


@contextlib.contextmanager
def serve(argv_for: Callable[[int], list[str]], env: dict[str, str] | None = None,
          name: str = "server") -> Iterator[Served]:
    """A server on a free loopback port (``argv_for(port)``), stopped and reaped on leaving."""
    port = free_port(LOOPBACK)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv_for(port), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        served = Served(f"{LOOPBACK}:{port}", proc.pid)
        try:
            if not wait_for_port(LOOPBACK, port, 60.0, lambda: proc.poll() is None):
                log.seek(0)
                raise RuntimeError(f"{name} did not listen on {served.address}: {_tail(log.read())}")
            yield served
        finally:
            served.rc, served.peak_kib = stop(proc)
            log.seek(0)
            served.log_tail = _tail(log.read())


def _tail(data: bytes, lines: int = 3) -> str:
    return " | ".join(data.decode(errors="replace").strip().splitlines()[-lines:])


def reference_argv(cli: Sequence[str], proto: str) -> Callable[[int], list[str]]:
    """``ggml-rpc serve`` of version ``proto`` (no hash cache) on a given port."""
    return lambda port: [*cli, "serve", "--host", LOOPBACK, "--port", str(port), "--proto", proto,
                         "--mem", REFERENCE_MEM]


@dataclass
class ProxyRun:
    """``ggml-rpc proxy --check --pcap`` in a process of its own: where it listens and what it printed."""

    address: str = ""
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0
    summary: str = ""
    rc: int | None = None
    peak_kib: int | None = None


@contextlib.contextmanager
def checking_proxy(cli: Sequence[str], upstream: str, pcap: Path, keep_lines: int = 20) -> Iterator[ProxyRun]:
    """The recording, checking proxy in front of ``upstream``; stopped with SIGINT (the pcap is completed)."""
    argv = [*cli, "proxy", "--listen", f"{LOOPBACK}:0", "--upstream", upstream, "--check", "--pcap", str(pcap)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    got = ProxyRun()
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            line = line.rstrip("\n")
            if line.startswith("VIOLATION"):
                got.violation_count += 1
                if len(got.violations) < keep_lines:
                    got.violations.append(line)
            elif (m := _BANNER.search(line)) and not got.address:
                got.address = f"{LOOPBACK}:{m[1]}"
                ready.set()
            elif _SUMMARY.search(line):
                got.summary = line
        ready.set()

    reader = threading.Thread(target=read, daemon=True, name="proxy-output")
    reader.start()
    try:
        if not ready.wait(60.0) or not got.address:
            raise RuntimeError(f"the proxy did not start listening: {got.summary or 'no banner'}")
        yield got
    finally:
        # SIGINT: the proxy completes the pcap and prints its summary; a multi-GB pcap may need a while to flush.
        got.rc, got.peak_kib = stop(proc, signal.SIGINT, timeout=600.0)
        reader.join(30.0)


def _client(peer: Peer, model: Path, rpc: str, prompt: str, n_predict: int, timeout: float) -> Finished:
    """Upstream llama-completion through ``rpc``: greedy, seeded, exactly ``n_predict`` tokens, its own cache."""
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-") as cache:
        argv = completion_argv(peer, model, rpc, prompt=prompt, n_predict=n_predict, ignore_eos=True)
        return run(argv, env=peer.env({"LLAMA_CACHE": cache}), timeout=timeout)


def _ended(done: Finished) -> dict[str, Any]:
    return {"seconds": round(done.seconds, 3), "rc": done.code, "timed_out": done.code is None,
            "why": None if done.ok else done.why()}


def record_session(peer: Peer, model: Path, pcap: Path, *, cli: Sequence[str] = KIT, prompt: str = PROMPT,
                   n_predict: int = 16, timeout: float = 900.0) -> dict[str, Any]:
    """The genuine client through ``proxy --check --pcap`` to a genuine server (with its hash cache, empty), as the
    interop matrix's GEN-PROXY rows run it: the capture's size, the proxy's violations and peak RSS."""
    if peer.kind != "sdist":
        raise ValueError(f"{peer.version}: the scale benchmark runs llama-completion (protocol 6 or 7 builds)")
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-") as cache:
        with serve(lambda port: peer.server_argv(port, cache=True), peer.env({"LLAMA_CACHE": cache}),
                   f"upstream {peer.version} rpc-server") as upstream:
            with checking_proxy(cli, upstream.address, pcap) as proxy:
                done = _client(peer, model, proxy.address, prompt, n_predict, timeout)
    return {"pcap_bytes": pcap.stat().st_size if pcap.exists() else 0, "client": _ended(done),
            "text": generated_text(done.stdout), **speeds(done.stderr),
            "proxy": {"peak_kib": proxy.peak_kib, "rc": proxy.rc, "violations": proxy.violation_count,
                      "first_violations": proxy.violations, "summary": proxy.summary},
            "upstream_server_peak_kib": upstream.peak_kib}


def tool_commands(cli: Sequence[str], pcap: Path, server: str, scratch: Path, timeout: float) -> dict[str, list[str]]:
    """The commands measured on a capture: the kit's decode, lint and replay (JSON reports into ``scratch``), and
    tshark reading every packet (the anchor; left out when tshark is not installed)."""
    import shutil

    out = {"decode": [*cli, "decode", str(pcap)],
           "lint": [*cli, "lint", str(pcap), "--json", str(scratch / "lint.jsonl")],
           "replay": [*cli, "replay", str(pcap), "--server", server, "--timeout", str(timeout),
                      "--json", str(scratch / "replay.json")]}
    if shutil.which("tshark"):
        out["tshark"] = ["tshark", "-r", str(pcap), "-q", "-z", "io,stat,0"]
    return out


def _findings(name: str, scratch: Path) -> dict[str, Any]:
    """What a run's JSON report says: lint's violations by rule, replay's mismatches and closeness."""
    if name == "lint":
        path = scratch / "lint.jsonl"
        found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        rules: dict[str, int] = {}
        for v in found:
            rule = str(v.get("rule", "?"))
            rules[rule] = rules.get(rule, 0) + 1
        return {"violations": len(found), "rules": rules}
    if name == "replay":
        path = scratch / "replay.json"
        if not path.exists():
            return {"report": None}
        r = json.loads(path.read_text())
        return {"requests": r["requests"], "compared": r["compared"], "mismatches": len(r["mismatches"]),
                "first_mismatches": [f"{m['index']} {m['command']} [{m['kind']}]: expected {m['expected']}, "
                                     f"got {m['got']}" for m in r["mismatches"][:5]],
                "cuts": len(r["cuts"]), "worst_nmse": r["worst_nmse"]}
    return {}


def measure_tools(pcap: Path, *, proto: str, rounds: int, cli: Sequence[str] = KIT, timeout: float = 900.0,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Each command of :func:`tool_commands` ``rounds`` times (interleaved), the replay's target a fresh
    ``ggml-rpc serve`` per round: per command, every run and the summary (median time, GB/s, peak RSS)."""
    size = pcap.stat().st_size
    runs: dict[str, list[dict[str, Any]]] = {}
    target_peaks: list[int | None] = []
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-scale-") as tmp:
        scratch = Path(tmp)
        for r in range(rounds):
            with serve(reference_argv(cli, proto), name="reference server") as ref:
                for name, argv in tool_commands(cli, pcap, ref.address, scratch, timeout).items():
                    for report in ("lint.jsonl", "replay.json"):  # nothing of an earlier run is read as this one's
                        (scratch / report).unlink(missing_ok=True)
                    got = measure(argv, timeout=timeout)
                    if got["rc"] in (0, 1) and not got["timed_out"]:
                        got.pop("stderr")
                    got |= _findings(name, scratch)
                    runs.setdefault(name, []).append(got)
                    progress(f"  {name} round {r + 1}/{rounds}: {got['seconds']:.2f} s, "
                             f"peak {got['peak_kib'] / 1024:.0f} MiB, rc {got['rc']}")
            target_peaks.append(ref.peak_kib)
    out = {name: summarise_runs(got, size) for name, got in runs.items()}
    out["replay"]["target_peak_kib"] = max((p for p in target_peaks if p), default=None)
    return out


def generate_once(peer: Peer, model: Path, side: str, *, proto: str, cli: Sequence[str] = KIT, prompt: str = PROMPT,
                  n_predict: int = 16, timeout: float = 900.0) -> dict[str, Any]:
    """One generation through a fresh server of ``side`` (``reference`` or ``upstream``), and that server's peak."""
    if side == "reference":
        argv, env = reference_argv(cli, proto), None
    else:
        argv, env = (lambda port: peer.server_argv(port, cache=False)), None
    with contextlib.ExitStack() as stack:
        if side != "reference":
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-"))
            env = peer.env({"LLAMA_CACHE": cache})
        with serve(argv, env, f"{side} server") as server:
            done = _client(peer, model, server.address, prompt, n_predict, timeout)
    return {**_ended(done), **speeds(done.stderr), "text": generated_text(done.stdout),
            "server_peak_kib": server.peak_kib}


def measure_generation(peer: Peer, model: Path, *, proto: str, rounds: int, cli: Sequence[str] = KIT,
                       prompt: str = PROMPT, n_predict: int = 16, timeout: float = 900.0,
                       progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Rounds of reference then upstream, each a fresh server: tokens/s of prompt and generation, peak RSS."""
    sides: dict[str, list[dict[str, Any]]] = {"reference": [], "upstream": []}
    for r in range(rounds):
        for side in sides:
            got = generate_once(peer, model, side, proto=proto, cli=cli, prompt=prompt, n_predict=n_predict,
                                timeout=timeout)
            sides[side].append(got)
            state = "timed out" if got["timed_out"] else f"rc {got['rc']}"
            progress(f"  generation round {r + 1}/{rounds} {side}: prompt {got['prompt_tps']} tok/s, eval "
                     f"{got['eval_tps']} tok/s, server peak {(got['server_peak_kib'] or 0) / 1024:.0f} MiB, {state}")
    return {"prompt": prompt, "n_predict": n_predict, "timeout": timeout, **summarise_generation(sides)}
