"""Fuzzing speed: executed messages per second of a campaign against the embedded reference server (loopback).

    python bench/bench_fuzz.py [--seconds S] [--proto 7] [--seed N]

Target: >= 2,000 executed messages per second (every message sent to the model and to the server, the reply
compared).  Also printed: the rate of seeded bursts alone (the same generators on a PRNG, through the same model,
server and checks, without hypothesis), for comparison.  The machine's load average is printed first: on a shared
2-core machine the figures move with it.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from ggml_rpc.conformance.fuzz import Options, embedded_campaign
from ggml_rpc.conformance.fuzz.campaign import rss_kib
from ggml_rpc.conformance.fuzz.example import Example
from ggml_rpc.conformance.fuzz.steps import burst
from ggml_rpc.spec import parse_version_option

TARGET_RATE = 2000.0


def campaign_rate(protocol, seconds: float, seed: int) -> tuple[float, int, int, int]:
    campaign = embedded_campaign(protocol, Options(seconds=seconds, seed=seed))
    campaign.target.start()
    try:
        findings = campaign.run()
    finally:
        campaign.target.stop()
    st = campaign.stats
    return st.rate, st.messages, st.examples, len(findings)


def execution_rate(protocol, seconds: float, seed: int) -> float:
    """Seeded bursts only (the generators on a PRNG), through the same model/target/invariant path."""
    campaign = embedded_campaign(protocol, Options(seconds=seconds, seed=seed))
    campaign.target.start()
    try:
        rng = random.Random(seed)
        messages = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            ex = Example(campaign)  # examples of a campaign's size: state does not pile up
            for _ in range(20):
                burst(ex, rng, 50)
            ex.finish()
            messages += ex.messages
        return messages / (time.perf_counter() - t0)
    finally:
        campaign.target.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--proto", default="7")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    protocol = parse_version_option(args.proto)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    rate, messages, examples, findings = campaign_rate(protocol, args.seconds, args.seed)
    verdict = "OK" if rate >= TARGET_RATE else "BELOW TARGET"
    print(f"campaign, protocol {protocol.label}: {messages} messages in {examples} examples, {rate:,.0f} execs/s "
          f"({rate / TARGET_RATE:.2f}x the {TARGET_RATE:,.0f}/s target: {verdict}); {findings} finding(s); "
          f"RSS {rss_kib() // 1024} MiB")
    ceiling = execution_rate(protocol, min(args.seconds, 10.0), args.seed)
    print(f"seeded bursts alone (no hypothesis, same checks): {ceiling:,.0f} messages/s")


if __name__ == "__main__":
    main()
