"""How long the whole conformance suite takes against the embedded reference server (protocol 7 and 6).

Prints wall-clock seconds per run (median of a few) and the slowest checks, so a slow check shows up.
Usage: python bench/bench_check.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.harness import EmbeddedTarget, Runner
from ggml_rpc.conformance.upstream.codebooks import tables
from ggml_rpc.spec import V6, V7


def one_run(proto) -> tuple[float, Runner]:
    t0 = time.perf_counter()
    with Runner(EmbeddedTarget(proto, codebooks=tables)) as runner:  # as `ggml-rpc check` starts it
        runner.run(CATALOGUE)
    return time.perf_counter() - t0, runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for proto in (V7, V6):
        times = []
        runner = None
        for _ in range(max(1, args.runs)):
            elapsed, runner = one_run(proto)
            times.append(elapsed)
        assert runner is not None
        s = runner.summary()
        print(f"protocol {proto.label}: {len(CATALOGUE)} checks in {statistics.median(times):.2f} s median "
              f"(min {min(times):.2f}, max {max(times):.2f}; budget 60 s); MUST failures {s['must_failures']}, "
              f"SHOULD failures {s['should_failures']}")
        slow = sorted(runner.results, key=lambda r: r.duration, reverse=True)[:5]
        print("  slowest: " + ", ".join(f"{r.check.id} {r.duration * 1000:.0f} ms" for r in slow))


if __name__ == "__main__":
    main()
