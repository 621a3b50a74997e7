"""Tokens per second of upstream ``llama-completion`` through the reference server and through upstream's own
``rpc-server``, side by side: what a user of either server feels.

Rounds are interleaved (reference, upstream, reference, upstream, ...) so that a change of machine load moves both
sides alike; each round is one generation of ``n_predict`` tokens, greedy, all layers on the RPC device, one
thread on each side (``-t 1`` for both programs, one BLAS thread for the reference server).  The figure of a
round is llama-completion's own ``eval time`` line (tokens generated after the prompt, per second of wall time), so
model loading and the prompt do not count.  Every run is bounded by a timeout.
"""

from __future__ import annotations

import re
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .models import BENCH_MODELS, ensure_models
from .peers import Peer, cache_root
from .runs import UpstreamServer, completion_argv, reference_server, run

#: llama-completion's timing line for the generated tokens, e.g.
#: ``eval time =  144.32 ms /  63 runs   (  2.29 ms per token,   436.52 tokens per second)``.
_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs\s*\(\s*([\d.]+) ms per token,\s*([\d.]+) tokens per "
                   r"second\)")
PROMPT = "Once upon a time"
TIMEOUT = 300.0


class GenerationError(Exception):
    """A generation did not run to its end (the message says which side and why)."""


@dataclass
class ServerRounds:
    """One server's rounds: tokens/s of each."""

    name: str
    rounds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rounds) if self.rounds else float("nan")


@dataclass
class GenerationResult:
    """A model's figure: the reference's and upstream's tokens/s, and their ratio (above 1: reference faster)."""

    model: str
    version: str
    n_predict: int
    reference: ServerRounds
    upstream: ServerRounds

    @property
    def ratio(self) -> float:
        return self.reference.median / self.upstream.median

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "version": self.version, "n_predict": self.n_predict,
                "reference_tokens_per_s": self.reference.rounds, "upstream_tokens_per_s": self.upstream.rounds,
                "reference_median": self.reference.median, "upstream_median": self.upstream.median,
                "ratio": self.ratio}


def tokens_per_second(stderr: str) -> float | None:
    """The generation speed llama-completion printed last, or None if it printed none."""
    found = _EVAL.findall(stderr)
    return float(found[-1][3]) if found else None


def generate(peer: Peer, model: Path, rpc: str, n_predict: int) -> float:
    """Tokens/s of one generation through the server at ``rpc``."""
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-") as cache:
        argv = completion_argv(peer, model, rpc, prompt=PROMPT, n_predict=n_predict, ignore_eos=True)
        done = run(argv, env=peer.env({"LLAMA_CACHE": cache}),
                   timeout=TIMEOUT)
    speed = tokens_per_second(done.stderr) if done.ok else None
    if speed is None:
        raise GenerationError(f"llama-completion through {rpc}: {done.why()}")
    return speed


def measure(peer: Peer, models: Sequence[str] = ("bench-f32", "bench-q8_0"), *, rounds: int = 3,
            n_predict: int = 64, progress: Callable[[str], None] | None = None) -> list[GenerationResult]:
    """The generation figure of each model in ``models`` (names of :data:`BENCH_MODELS`), ``rounds`` interleaved
    rounds per server.  Each server is started once per model and serves every round of it."""
    unknown = [m for m in models if m not in BENCH_MODELS]
    if unknown:
        raise ValueError(f"unknown bench model {unknown[0]!r} (choose from {', '.join(BENCH_MODELS)})")
    if rounds < 1 or n_predict < 2:
        raise ValueError("at least one round of at least two tokens")
    paths = ensure_models(cache_root() / "models", peer.vocab, list(models), table=BENCH_MODELS)
    results = []
    for name in models:
        sides = {label: ServerRounds(label) for label in ("reference", "upstream")}
        with reference_server(peer.major, None) as ref_addr, UpstreamServer(peer, cache=False) as upstream:
            addresses = {"reference": ref_addr, "upstream": upstream.address}
            for r in range(rounds):
                for label in ("reference", "upstream"):
                    speed = generate(peer, paths[name], addresses[label], n_predict)
                    sides[label].rounds.append(speed)
                    if progress is not None:
                        progress(f"{name} round {r + 1}/{rounds}: {label} {speed:,.1f} tokens/s")
        results.append(GenerationResult(name, peer.version, n_predict, sides["reference"], sides["upstream"]))
    return results
