"""Time and peak RSS of decode, lint and replay on a synthetic capture of about 1 GB, beside tshark reading it.

    python bench/bench_bounded.py [--tensors 2] [--size-mib 256] [--cli PATH/TO/ggml-rpc] [--json OUT.json]

``--cli`` picks the ``ggml-rpc`` to measure (another checkout's venv measures its code on the same file); the
reference server the replay targets runs in this process, so the replay's figure is the replayer's alone.  Each
command runs as the only child of a fresh wrapper, whose RUSAGE_CHILDREN gives its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ggml_rpc.bench.large_capture import MiB, measure, write_large_capture
from ggml_rpc.reference import running_server


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=2)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--cli", default=shutil.which("ggml-rpc") or "ggml-rpc")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="write the capture here and keep it (default: a temporary file)")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="ggml-rpc-bounded-")
    path = Path(args.keep) if args.keep else Path(tmp.name) / "large.pcap"
    try:
        if not path.exists():
            start = time.perf_counter()
            write_large_capture(path, tensors=args.tensors, size=args.size_mib * MiB)
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s")
        size = path.stat().st_size
        figures = {}
        baseline = measure([sys.executable, "-c", "import ggml_rpc.conformance.cli"])
        figures["interpreter_baseline"] = baseline
        with running_server("7", mem=4 << 30, max_size=4 << 30) as srv:
            runs = {
                "decode": [args.cli, "decode", str(path)],
                "lint": [args.cli, "lint", str(path)],
                "replay": [args.cli, "replay", str(path), "--server", f"{srv.host}:{srv.port}"],
            }
            if shutil.which("tshark"):
                runs["tshark"] = ["tshark", "-r", str(path), "-q", "-z", "conv,tcp"]
            for name, argv in runs.items():
                got = measure(argv)
                figures[name] = got
                print(f"{name:>8}: {got['seconds']:6.2f} s  {size / got['seconds'] / 1e9:5.2f} GB/s  "
                      f"peak RSS {got['peak_kib'] / 1024:7.1f} MiB  rc {got['rc']}")
        if args.json:
            record = {"capture_bytes": size, "tensors": args.tensors, "tensor_mib": args.size_mib,
                      "cli": args.cli, "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                                   "load_average": list(os.getloadavg())},
                      "commit": _commit(args.cli), "figures": figures}
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    finally:
        tmp.cleanup()


def _commit(cli: str) -> dict:
    """The commit of the checkout ``cli`` runs, and whether its tree was dirty."""
    code = subprocess.run([cli, "--help"], capture_output=True).returncode  # the CLI exists
    where = subprocess.run([Path(cli).parent / "python", "-c", "import ggml_rpc.conformance as c; print(c.__file__)"],
                           capture_output=True, text=True).stdout.strip()
    root = Path(where or ".").parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout
    return {"checkout": str(root), "head": head.strip(), "dirty": bool(dirty.strip()), "cli_rc": code}


if __name__ == "__main__":
    main()
