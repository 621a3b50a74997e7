"""The model zoo: tiny random-weight models quantised the way users get theirs, by upstream's own tools.

Each zoo model is a shape (:data:`SHAPES`: architecture, width, heads, experts) written in F32 by
:func:`.models.write_model`, then quantised by an installed peer's ``llama-quantize`` into one of the file types it
offers (:data:`FILE_TYPES`), so that the file holds upstream's own mix (output.weight Q6_K, some layers one type up,
fallbacks where rows are not a multiple of 256).  The types that need an importance matrix
(:data:`IMATRIX_TYPES`) get one computed by the same peer's ``llama-imatrix`` on :func:`imatrix_text`.

A peer quantises with its own programs; the wheel peer (8.0.0) has none, so its zoo is the newest installed sdist
peer's files (the file format does not change with the protocol).  Files are named by the quantiser's version and a
digest of everything that made them, written under a temporary name and renamed, so a reused folder never hands out
a stale or partial file.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models import GENERATOR_VERSION, write_model, write_once
from .peers import Peer, installed_peers

#: Every shape is 2 layers over upstream's 32,000-token vocabulary, trained context 256.
_COMMON: dict[str, Any] = {"n_layer": 2, "n_ctx_train": 256}

#: Shapes of the zoo, by name.  ``e256-kv2`` is the main one: rows of 256 (so K-quants apply without fallback) and
#: grouped-query attention with 2 key/value heads for 4 query heads.
SHAPES: dict[str, dict[str, Any]] = {
    "e256-kv2": {"n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, **_COMMON},
    "e128-kv1": {"n_embd": 128, "n_head": 4, "n_head_kv": 1, "n_ff": 256, **_COMMON},
    "e96": {"n_embd": 96, "n_head": 2, "n_head_kv": 2, "n_ff": 256, **_COMMON},
    "e512-kv2": {"n_embd": 512, "n_head": 8, "n_head_kv": 2, "n_ff": 1024, **_COMMON},
    "qwen2": {"arch": "qwen2", "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, **_COMMON},
    "qwen3": {"arch": "qwen3", "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, **_COMMON},
    "gemma": {"arch": "gemma", "n_embd": 256, "n_head": 4, "n_head_kv": 1, "n_ff": 512, **_COMMON},
    "moe": {"n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 256, "n_expert": 4, "n_expert_used": 2, **_COMMON},
    "phi3": {"arch": "phi3", "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, **_COMMON},
    # Recurrent: no attention (the head counts are the writer's defaults, unused), d_inner 512.
    "mamba": {"arch": "mamba", "n_embd": 256, "n_head": 4, "n_head_kv": 4, "n_ff": 512, **_COMMON},
}

#: ``llama-quantize``'s file types the zoo makes without an importance matrix.
FILE_TYPES: tuple[str, ...] = (
    "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q1_0", "Q2_0",
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
)
#: File types made with an importance matrix computed by the peer's ``llama-imatrix`` (upstream refuses some of
#: them without one, and users make all of them with one).
IMATRIX_TYPES: tuple[str, ...] = (
    "Q2_K_S", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
)
#: File types only a mixture of experts is made in (its experts in that type).
MOE_TYPES: tuple[str, ...] = ("MXFP4_MOE",)
#: What ``llama-quantize --help`` lists that the zoo deliberately does not make: F32 is the unquantised input itself.
NOT_MADE: tuple[str, ...] = ("F32", "COPY")


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: a shape quantised to a file type."""

    name: str
    shape: str
    ftype: str

    @property
    def imatrix(self) -> bool:
        return self.ftype in IMATRIX_TYPES


def _zoo() -> dict[str, ZooModel]:
    models = [ZooModel(f"zoo-{t.lower()}", "e256-kv2", t) for t in (*FILE_TYPES, *IMATRIX_TYPES)]
    # Other shapes, each in types whose path there differs: fallbacks for rows that are not a multiple of 256
    # (n_embd 96 and 128), one key/value head, a wider model, and the architectures beyond llama.
    models += [ZooModel(f"zoo-{shape}-{t.lower()}", shape, t) for shape, types in (
        ("e128-kv1", ("Q4_0", "Q5_K_M", "IQ4_XS")),
        ("e96", ("Q5_1", "Q4_K_M", "Q8_0")),
        ("e512-kv2", ("Q4_K_M", "Q6_K", "IQ2_XS")),
        ("qwen2", ("Q4_K_M", "Q8_0")),
        ("qwen3", ("Q5_K_S", "F16")),
        ("gemma", ("Q4_0", "Q6_K")),
        ("moe", ("Q4_K_M", "Q8_0", "MXFP4_MOE")),
        ("phi3", ("Q4_K_M", "Q8_0")),
        ("mamba", ("F16", "Q4_K_M", "Q8_0")),
    ) for t in types]
    return {m.name: m for m in models}


#: Every zoo model, by name.
ZOO: dict[str, ZooModel] = _zoo()

#: The subset CI runs: a legacy quant with one key/value head and a Q8_0 output, a K-quant mix (Q4_K with Q6_K),
#: imatrix-made i-quants, IQ4_XS with GQA, biases (qwen2), a mixture of experts (MUL_MAT_ID) and a recurrent model
#: (SSM_CONV, SSM_SCAN and the state's copies).  Every zoo model passes on 6.0.0, 7.0.0 and 8.0.0 in INTEROP.md's
#: run (8.0.0's Q2_0 too, since the reference dots Q2_0 as 8.0.0's build does); ``ggml-rpc interop --zoo`` runs
#: them all.
CI_ZOO: tuple[str, ...] = ("zoo-e128-kv1-q4_0", "zoo-q4_k_m", "zoo-e128-kv1-iq4_xs", "zoo-iq3_xs", "zoo-iq2_s",
                           "zoo-qwen2-q8_0", "zoo-moe-q4_k_m", "zoo-mamba-q4_k_m")


def zoo_option(text: str) -> list[str]:
    """``--zoo``'s value: ``ci`` (the default subset), ``all``, ``none`` or comma-separated model names."""
    text = text.strip()
    if text == "none":
        return []
    if text == "ci":
        return list(CI_ZOO)
    if text == "all":
        return list(ZOO)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown or not names:
        raise ValueError(f"unknown zoo model {unknown[0] if unknown else text!r} (ci, all, none, or names: "
                         f"{', '.join(ZOO)})")
    return names


def quantizer_for(peer: Peer) -> Peer:
    """The peer whose ``llama-quantize`` makes ``peer``'s zoo: its own (a built peer's, or Debian's through its
    loader), or, for a peer without programs (the wheel), the newest installed built one."""
    if peer.kind in ("sdist", "debian") and peer.llama_quantize.is_file():
        return peer  # Debian's programs run through its own loader (Peer.command)
    with_programs = [p for p in installed_peers() if p.kind == "sdist" and p.llama_quantize.is_file()]
    if not with_programs:
        raise RuntimeError(f"no installed peer has llama-quantize to make {peer.version}'s zoo")
    return max(with_programs, key=lambda p: p.major)


def offered_file_types(quantizer: Peer) -> list[str]:
    """The file types ``llama-quantize --help`` lists (aliases left out)."""
    done = subprocess.run(quantizer.command(quantizer.llama_quantize, "--help"), capture_output=True, text=True,
                          env=quantizer.env(), timeout=60)
    found = re.findall(r"^\s*\d+\s+or\s+(\S+)\s*:\s*(.*)$", done.stdout + done.stderr, re.M)
    return [name for name, what in found if not what.startswith("alias")]


def imatrix_text(n_words: int = 3000, seed: int = 0) -> str:
    """The calibration text for ``llama-imatrix``: common English words in a seeded order (no file to ship, the
    same text on every machine)."""
    words = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
             "an they you were her she there one all we their has been would when more will who so if no out two my "
             "what up said time about than into them can only other new some could these its very any may then first "
             "people like now over such").split()
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(n_words)) + "\n"


def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True).encode())
        h.update(b"\0")
    return h.hexdigest()[:10]


def _run(argv: list[str], quantizer: Peer, what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, env=quantizer.env(), timeout=600)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {' | '.join(tail)}")


def ensure_zoo(folder: Path, peer: Peer, names: list[str]) -> dict[str, Path]:
    """The zoo models ``names`` for ``peer`` in ``folder``, made only when missing (base F32 file, importance matrix
    and quantised file each cached under a name that changes with whatever made it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    quantizer = quantizer_for(peer)
    vocab = quantizer.vocab
    vocab_digest = hashlib.sha256(vocab.read_bytes()).hexdigest()
    out: dict[str, Path] = {}
    for name in names:
        model = ZOO[name]
        params = SHAPES[model.shape]
        base_key = _digest(GENERATOR_VERSION, params, vocab_digest)
        base = write_once(folder / f"base-{model.shape}-{base_key}.gguf",
                       lambda tmp, p=params: write_model(tmp, ftype="F32", vocab_path=vocab, **p))
        argv = quantizer.command(quantizer.llama_quantize)
        key: list[Any] = [base_key, quantizer.requirement, model.ftype]
        if model.imatrix:
            text = folder / f"imatrix-text-{_digest(imatrix_text())}.txt"
            if not text.is_file():
                text.write_text(imatrix_text())
            imatrix = write_once(folder / f"imatrix-{model.shape}-{quantizer.label}-{base_key}.gguf",
                              lambda tmp, b=base, t=text: _run(
                                  quantizer.command(quantizer.program("llama-imatrix"), "-m", str(b), "-f", str(t),
                                                    "-o", str(tmp), "-c", "128", "--chunks", "8", "-t", "1"),
                                  quantizer, "llama-imatrix"))
            argv += ["--imatrix", str(imatrix)]
            key.append(hashlib.sha256(imatrix.read_bytes()).hexdigest())
        path = folder / f"{name}-{quantizer.label}-{_digest(*key)}.gguf"
        out[name] = write_once(path, lambda tmp, a=argv, b=base, m=model: _run(
            [*a, str(b), str(tmp), m.ftype, "1"], quantizer, f"llama-quantize {m.ftype}"))
    return out
