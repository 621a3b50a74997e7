"""Hunt speed against genuine servers: messages/s and restarts/s of ``ggml-rpc fuzz --hunt --spawn``, per target and
restart mode (a new process per death, or a fork of the first one: the kit's fork server).

    python bench/bench_hunt.py [--peer 8.0.0 --peer 8.0.0+debian --peer 7.0.0 --peer reference-8] [--seconds 600]
                               [--modes process,fork] [--seed 0] [--cli PATH/TO/ggml-rpc] [--json OUT.json]
                               [--keep DIR]

Each run is one campaign of ``--seconds``, run one at a time (the campaigns share the machine's cores with nothing of
this script's). The servers are the installed peers (``ggml-rpc upstream list``), started as a user runs them: an
sdist build's or Debian's server with ``-c`` (its cache in a folder the fuzzer owns), a wheel peer's entry module
without a cache. ``reference-N`` is the kit's own server (``ggml-rpc serve --proto N``) spawned the same way: the
same campaign must find nothing there.
``--keep DIR`` keeps each campaign's output (findings.json, SARIF, reproducers) in ``DIR/<target>-<mode>/``.
``--cli`` measures another checkout's ``ggml-rpc`` (``before``: a version without the fork server, run without the
option it lacks). Target: >= 200 messages/s on 2 cores against 7.0.0 and 8.0.0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ggml_rpc.conformance.provenance import git_state
from ggml_rpc.conformance.upstream.peers import PEERS, Peer, debian_peer

TARGET_RATE = 200.0
MODES = ("process", "fork", "before")


def spawn_command(peer: Peer) -> str:
    """The ``--spawn`` command line of ``peer``'s server: its own environment (no ``LLAMA_CACHE``: the fuzzer sets
    its own for ``-c``), loopback, one thread."""
    env = peer.launch_env()
    argv = peer.server_argv("{port}", cache=peer.kind != "wheel")
    return shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv]).replace("'{port}'", "{port}")


def reference_command(cli: str, proto: str) -> str:
    """The ``--spawn`` command line of the kit's own server of protocol ``proto``."""
    return shlex.join([cli, "serve", "--proto", proto, "--host", "127.0.0.1"]) + " --port {port}"


def run(cli: str, label: str, command: str, mode: str, seconds: float, seed: int,
        keep: Path | None = None) -> dict[str, Any]:
    """One campaign; its findings.json summary and the rates (its whole output kept in ``keep`` when given)."""
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-bench-hunt-") as tmp:
        out = keep if keep is not None else Path(tmp)
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
            keep.mkdir(parents=True)
        argv = [cli, "fuzz", "--hunt", "--spawn", command, "--seconds", str(seconds), "--seed", str(seed),
                "-o", str(out)] + (["--no-fork-server"] if mode == "process" else [])
        if mode != "before":
            argv += ["--sarif", str(out / "findings.sarif")]
        started = time.monotonic()
        p = subprocess.run(argv, capture_output=True, text=True, timeout=seconds * 3 + 600)
        wall = time.monotonic() - started
        found = out / "findings.json"
        if not found.is_file():
            raise SystemExit(f"{label} {mode}: no findings.json (exit {p.returncode}): {p.stderr[-600:]}")
        data = json.loads(found.read_text())
    restart_line = next((line for line in p.stderr.splitlines() if line.startswith("restarts:")), "")
    secs = float(data["seconds"]) or 1.0
    classes = data["classes"]
    return {
        "target": label, "mode": mode, "command": command, "seed": seed, "budget_seconds": seconds,
        "wall_seconds": round(wall, 1), "seconds": data["seconds"], "examples": data["examples"],
        "messages": data["messages"], "messages_per_second": round(data["messages"] / secs, 1),
        "restarts": data["restarts"], "restarts_per_second": round(data["restarts"] / secs, 2),
        "fork_restarts": data.get("fork_restarts", 0), "shrink_replays": data.get("shrink_replays"),
        "findings_seen": data.get("findings_seen"), "classes": len(classes),
        "verified": sum(1 for c in classes if c["verified"]), "restart_mode": restart_line, "exit_code": p.returncode,
        "by_kind": dict(Counter(c["kind"] for c in classes)),
        "verified_by_kind": dict(Counter(c["kind"] for c in classes if c["verified"])),
        "shadow_reads": data.get("shadow_reads"), "kept": str(keep) if keep is not None else None,
        "class_ids": sorted(c["class"] for c in classes),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", action="append", default=[], help="an installed peer: its version, or VERSION+debian "
                   "for Debian's build (default: 7.0.0 and 8.0.0, those installed)")
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--modes", default="process,fork", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cli", default=shutil.which("ggml-rpc") or "ggml-rpc")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", type=Path, default=None, help="keep each campaign's output in DIR/<target>-<mode>/")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    versions = args.peer or [v for v in ("7.0.0", "8.0.0") if PEERS[v].installed()]
    references = [v.removeprefix("reference-") for v in versions if v.startswith("reference-")]
    try:
        peers = [debian_peer(v.split("+")[0]) if v.endswith("+debian") else PEERS[v] for v in versions
                 if not v.startswith("reference-")]
    except (KeyError, ValueError) as exc:
        p.error(f"--peer: {exc}")
    missing = [peer.version for peer in peers if not peer.installed()]
    if missing:
        p.error(f"not installed: {', '.join(missing)} (ggml-rpc upstream install)")
    commit, dirty = git_state()
    cli_commit, cli_dirty = git_state(Path(os.path.realpath(args.cli)).parents[2]) \
        if Path(args.cli).is_absolute() else (commit, dirty)
    record: dict[str, Any] = {
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "load_average_start": os.getloadavg()[0], "commit": commit, "dirty": dirty,
                    "cli": args.cli, "cli_commit": cli_commit, "cli_dirty": cli_dirty},
        "target_messages_per_second": TARGET_RATE, "runs": [],
    }
    targets = [(peer.label, spawn_command(peer)) for peer in peers]
    targets += [(f"reference-{proto}", reference_command(args.cli, proto)) for proto in references]
    for label, command in targets:
        for mode in modes:
            print(f"{label} {mode}: {args.seconds:g} s ...", file=sys.stderr, flush=True)
            keep = args.keep / f"{label}-{mode}" if args.keep is not None else None
            result = run(args.cli, label, command, mode, args.seconds, args.seed, keep)
            result["load_average_after"] = os.getloadavg()[0]
            record["runs"].append(result)
            print(f"  {result['messages_per_second']:,.1f} messages/s, {result['restarts_per_second']:.2f} "
                  f"restarts/s ({result['fork_restarts']} forks), {result['examples']} examples, "
                  f"{result['classes']} classes ({result['verified']} verified)", file=sys.stderr, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["runs"], indent=2))


if __name__ == "__main__":
    main()
