"""Sessions of real size: genuine upstream sessions of kit-generated models of about 0.1, 1.6 and 4 GB, each recorded
through ``ggml-rpc proxy --check --pcap``, then decoded, linted and replayed beside tshark reading the same capture,
and generated through the reference server and upstream's own.

    python bench/bench_scale.py --sizes 0.1,1.6,4 --rounds 3,3,1 --n-predict 16,16,4 --proto 6 --workdir DIR
                                [--keep] [--steps session,tools,generation] [--timeout S] [--lock FILE]
                                [--json OUT.json] [--markdown FILE|-]

Per size (a model of ``SCALE_MODELS``, written once into ``--models-dir``): **session** runs upstream
llama-completion through the checking proxy to upstream rpc-server (its hash cache on, empty) and records the capture
in ``--workdir`` (the proxy's peak RSS and violations); **tools** times ``ggml-rpc decode``, ``lint`` and ``replay``
(against ``ggml-rpc serve``) and ``tshark -r FILE -q -z io,stat,0`` on it, ``--rounds`` rounds, each run the only
child of a wrapper (wall time, peak RSS); **generation** runs the same client through a fresh reference server and a
fresh upstream server per round: prompt and generation tokens/s, each server's peak RSS, same text or not.  Every
run has the time limit ``--timeout``; a run that reaches it is recorded as timed out.  ``--lock FILE`` holds an
exclusive ``flock`` on FILE during each heavy step only (model writing, each step of each size), so that other
measurements taking the same lock interleave between steps.  ``--json`` updates an existing record of the same
protocol version size by size and step by step (figures of steps not run are kept), so sizes and steps can be run
separately.  Captures are deleted after their size unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ggml_rpc.bench.scale import KIT, PROMPT, measure_generation, measure_tools, record_session
from ggml_rpc.bench.scale_report import markdown
from ggml_rpc.conformance import kit_version
from ggml_rpc.conformance.upstream.models import SCALE_MODELS, ensure_models
from ggml_rpc.conformance.upstream.peers import Peer, cache_root, peer_for

SCHEMA = 1
STEPS = ("session", "tools", "generation")
ROOT = Path(__file__).resolve().parents[1]


def _sizes(text: str) -> list[str]:
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in sizes if f"scale-{s}" not in SCALE_MODELS]
    if not sizes or unknown:
        known = ", ".join(name.removeprefix("scale-") for name in SCALE_MODELS)
        raise argparse.ArgumentTypeError(f"unknown size {unknown[0] if unknown else text!r} (known: {known})")
    return sizes


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be at least 1: {text!r}")
    return values


def _steps(text: str) -> list[str]:
    steps = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if not steps or unknown:
        raise argparse.ArgumentTypeError(f"unknown step {unknown[0] if unknown else text!r} (known: "
                                         f"{', '.join(STEPS)})")
    return steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_scale.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_sizes, default=_sizes("0.1,1.6,4"),
                   help="model sizes in GB, of: " + ", ".join(n.removeprefix("scale-") for n in SCALE_MODELS))
    p.add_argument("--rounds", type=_ints, default=[3], help="rounds per size (one value, or one per size)")
    p.add_argument("--n-predict", type=_ints, default=[16],
                   help="tokens generated per run, per size (one value, or one per size)")
    p.add_argument("--proto", default="6", choices=["6", "7"], help="upstream version (a llama-completion build)")
    p.add_argument("--steps", type=_steps, default=list(STEPS), help="which steps to run: " + ",".join(STEPS))
    p.add_argument("--workdir", type=Path, default=None, help="captures go here (default: a temporary folder)")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="where models are written once and reused (default: the upstream peers' models folder)")
    p.add_argument("--keep", action="store_true", help="keep each capture after its size is done")
    p.add_argument("--timeout", type=float, default=900.0, help="time limit of any one run, in seconds")
    p.add_argument("--lock", default=None, metavar="FILE", help="hold flock(FILE) during each heavy step")
    p.add_argument("--prompt", default=PROMPT, help="the prompt of every generation")
    p.add_argument("--json", type=Path, default=None, help="write (or update) the record here")
    p.add_argument("--markdown", default=None, metavar="FILE|-", help="write the tables of the record here")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, with ``rounds`` and ``n_predict`` spread to one value per size (as ``per_size``)."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("rounds", "n_predict"):
        values = getattr(args, name)
        if len(values) == 1:
            values = values * len(args.sizes)
        if len(values) != len(args.sizes):
            p.error(f"--{name.replace('_', '-')}: {len(values)} values for {len(args.sizes)} sizes")
        setattr(args, name, values)
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


@contextlib.contextmanager
def locked(path: str | None) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the duration (nothing when ``path`` is None)."""
    if path is None:
        yield
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for the lock {path}...", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tree_state(root: Path = ROOT) -> dict[str, Any]:
    """The commit of the checkout holding this script and whether its tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()

    return {"head": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def stamp() -> dict[str, Any]:
    """When and on what a step's figures were taken."""
    return {"at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), **tree_state(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def new_record(peer: Peer, command: Sequence[str]) -> dict[str, Any]:
    return {"schema": SCHEMA, "command": " ".join(command), "proto": peer.version, "upstream": peer.requirement,
            "machine": {"kit_version": kit_version(), "python": platform.python_version(),
                        "platform": platform.platform(), "cpus": os.cpu_count(),
                        "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)},
            "sizes": []}


def load_record(path: Path | None, peer: Peer, command: Sequence[str]) -> dict[str, Any]:
    """The record at ``path`` to update when it is of this schema and version, else a new one."""
    if path is not None and path.is_file():
        old = json.loads(path.read_text())
        if old.get("schema") == SCHEMA and old.get("proto") == peer.version:
            old["command"] = " ".join(command)
            return old
    return new_record(peer, command)


def entry_for(record: dict[str, Any], size: str) -> dict[str, Any]:
    """The record's entry of ``size``, added (in order of size) when missing."""
    for entry in record["sizes"]:
        if entry["size"] == size:
            return entry
    entry = {"size": size}
    record["sizes"] = sorted([*record["sizes"], entry], key=lambda e: float(e["size"]))
    return entry


def run_size(args: argparse.Namespace, peer: Peer, record: dict[str, Any], index: int, workdir: Path) -> None:
    size, rounds, n_predict = args.sizes[index], args.rounds[index], args.n_predict[index]
    name = f"scale-{size}"
    entry = entry_for(record, size)
    print(f"== {name}: {rounds} round(s), {n_predict} tokens", flush=True)
    started = time.perf_counter()
    with locked(args.lock):
        model = ensure_models(args.models_dir or cache_root() / "models", peer.vocab, [name], table=SCALE_MODELS)[name]
    print(f"  model {model} ({model.stat().st_size / 1e9:.2f} GB; ready in {time.perf_counter() - started:.0f} s)")
    entry["model"] = {"name": name, "file": model.name, "bytes": model.stat().st_size, "shape": SCALE_MODELS[name]}
    entry |= {"rounds": rounds, "n_predict": n_predict}
    pcap = workdir / f"v{peer.major}-{name}.pcap"
    common = {"cli": KIT, "timeout": args.timeout}
    try:
        if "session" in args.steps:
            with locked(args.lock):
                session = record_session(peer, model, pcap, prompt=args.prompt, n_predict=n_predict, **common)
            entry["session"] = {**session, "taken": stamp()}
            print(f"  session: {session['pcap_bytes'] / 1e9:.2f} GB captured in {session['client']['seconds']:.1f} s, "
                  f"proxy peak {session['proxy']['peak_kib'] / 1024:.0f} MiB, "
                  f"{session['proxy']['violations']} violations", flush=True)
        if "tools" in args.steps:
            if not pcap.is_file():
                entry["tools"] = {"error": f"no capture {pcap} (run the session step first, with --keep)"}
            else:
                with locked(args.lock):
                    entry["tools"] = {**measure_tools(pcap, proto=peer.version, rounds=rounds, **common),
                                      "capture_bytes": pcap.stat().st_size, "taken": stamp()}
        if "generation" in args.steps:
            with locked(args.lock):
                gen = measure_generation(peer, model, proto=peer.version, rounds=rounds, prompt=args.prompt,
                                         n_predict=n_predict, **common)
            entry["generation"] = {**gen, "taken": stamp()}
    finally:
        if not args.keep:
            pcap.unlink(missing_ok=True)
        _save(args, record)


def _save(args: argparse.Namespace, record: dict[str, Any]) -> None:
    record["commit"] = tree_state()
    if args.json is not None:
        tmp = args.json.with_name(f".{args.json.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    peer = peer_for(int(args.proto))
    if not peer.installed():
        print(f"upstream {peer.version} is not installed: run `ggml-rpc upstream install --proto {args.proto}`",
              file=sys.stderr)
        return 2
    record = load_record(args.json, peer, [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)])
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ggml-rpc-scale-")))
        workdir.mkdir(parents=True, exist_ok=True)
        for index in range(len(args.sizes)):
            run_size(args, peer, record, index, workdir)
    tables = markdown(record)
    if args.markdown == "-":
        print(tables)
    elif args.markdown:
        Path(args.markdown).write_text(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
