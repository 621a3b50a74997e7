"""Tiny random-weight llama models in GGUF, deterministic from a seed, for end-to-end runs of upstream programs.

The vocabulary (SentencePiece, 32,000 tokens) is copied from upstream's ``ggml-vocab-llama-spm.gguf``, kept from the
same sdist as the build; the weights come from ``numpy.random.default_rng(seed)`` and are small, so greedy generation
is numerically tame and identical on every run. Quantised models use gguf's own quantiser.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Above this size upstream clients hash a tensor before sending it (SET_TENSOR_HASH).
HASH_MIN_SIZE = 10 * 1024 * 1024

#: Shapes small enough that a whole session is a few MB; ``tiny-f32-big`` has an output.weight above 10 MiB
#: (32,000 x 96 x 4 bytes = 12.3 MB) so that the hash path runs.
_TINY = {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_head_kv": 2, "n_ff": 128, "n_ctx_train": 256}
STANDARD_MODELS: dict[str, dict[str, Any]] = {
    "tiny-q8_0": {"ftype": "Q8_0", **_TINY},
    "tiny-q4_0": {"ftype": "Q4_0", **_TINY},
    "tiny-f16": {"ftype": "F16", **_TINY},
    "tiny-f32": {"ftype": "F32", **_TINY},
    "tiny-f32-big": {"ftype": "F32", **_TINY, "n_embd": 96, "n_ff": 192},
}

_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}  # llama_ftype values of general.file_type


@dataclass
class ModelInfo:
    path: Path
    ftype: str
    tensor_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def above_hash_threshold(self) -> list[str]:
        return [n for n, size in self.tensor_bytes.items() if size > HASH_MIN_SIZE]


def _copy_vocab(writer: Any, vocab_path: Path) -> int:
    """Copy every tokenizer.* key of the vocabulary file; returns the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(vocab_path)
    n_vocab = 0
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == GGUFValueType.STRING:
                values: Any = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                values = [f.parts[i].tolist()[0] for i in f.data]
            writer.add_array(key, values)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, bytes(f.parts[f.data[0]]).decode("utf-8"))
        elif kind == GGUFValueType.BOOL:
            writer.add_bool(key, bool(f.parts[f.data[0]][0]))
        elif kind == GGUFValueType.UINT32:
            writer.add_uint32(key, int(f.parts[f.data[0]][0]))
        elif kind == GGUFValueType.INT32:
            writer.add_int32(key, int(f.parts[f.data[0]][0]))
        elif kind == GGUFValueType.FLOAT32:
            writer.add_float32(key, float(f.parts[f.data[0]][0]))
    if not n_vocab:
        raise ValueError(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n_vocab


def _store(writer: Any, name: str, data: np.ndarray, ftype: str, sizes: dict[str, int]) -> None:
    """Add one tensor: norms (1-D) stay F32, matrices take the model's type (output.weight Q8_0 in a Q4_0 model)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kind = ftype if data.ndim == 2 else "F32"
    if kind == "Q4_0" and name == "output.weight":
        kind = "Q8_0"  # as llama-quantize does for a Q4_0 model's output
    if kind == "F32":
        arr = data.astype(np.float32)
        writer.add_tensor(name, arr)
    elif kind == "F16":
        arr = data.astype(np.float16)
        writer.add_tensor(name, arr)
    else:
        qtype = getattr(GGMLQuantizationType, kind)
        arr = quantize(data.astype(np.float32), qtype)
        writer.add_tensor(name, arr, raw_dtype=qtype)
    sizes[name] = int(arr.nbytes)


def write_model(path: Path, *, ftype: str, vocab_path: Path, seed: int = 0, n_embd: int = 64, n_layer: int = 2,
                n_head: int = 2, n_head_kv: int = 2, n_ff: int = 128, n_ctx_train: int = 256) -> ModelInfo:
    """Write a random-weight llama model; the same arguments give the same bytes."""
    from gguf import GGUFWriter

    if ftype not in _FILE_TYPE:
        raise ValueError(f"unsupported ftype {ftype!r} (choose from {', '.join(_FILE_TYPE)})")
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"ggml-rpc-kit tiny llama {ftype} seed {seed}")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(_FILE_TYPE[ftype])
    n_vocab = _copy_vocab(writer, vocab_path)
    writer.add_vocab_size(n_vocab)

    def weights(rows: int, cols: int) -> np.ndarray:
        # numpy shape (rows, cols) is ggml ne = [cols, rows]: a weight maps cols inputs to rows outputs.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    sizes: dict[str, int] = {}
    head_dim = n_embd // n_head
    _store(writer, "token_embd.weight", weights(n_vocab, n_embd), ftype, sizes)
    for i in range(n_layer):
        _store(writer, f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32), ftype, sizes)
        _store(writer, f"blk.{i}.attn_q.weight", weights(n_embd, n_embd), ftype, sizes)
        _store(writer, f"blk.{i}.attn_k.weight", weights(n_head_kv * head_dim, n_embd), ftype, sizes)
        _store(writer, f"blk.{i}.attn_v.weight", weights(n_head_kv * head_dim, n_embd), ftype, sizes)
        _store(writer, f"blk.{i}.attn_output.weight", weights(n_embd, n_embd), ftype, sizes)
        _store(writer, f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32), ftype, sizes)
        _store(writer, f"blk.{i}.ffn_gate.weight", weights(n_ff, n_embd), ftype, sizes)
        _store(writer, f"blk.{i}.ffn_up.weight", weights(n_ff, n_embd), ftype, sizes)
        _store(writer, f"blk.{i}.ffn_down.weight", weights(n_embd, n_ff), ftype, sizes)
    _store(writer, "output_norm.weight", np.ones(n_embd, np.float32), ftype, sizes)
    _store(writer, "output.weight", weights(n_vocab, n_embd), ftype, sizes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelInfo(Path(path), ftype, sizes)


def ensure_models(folder: Path, vocab_path: Path, names: list[str] | None = None, seed: int = 0) -> dict[str, Path]:
    """The standard models in ``folder``, written when missing (to a temporary name, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha256(vocab_path.read_bytes()).hexdigest()[:8]
    out = {}
    for name in names or list(STANDARD_MODELS):
        path = folder / f"{name}-s{seed}-{tag}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            write_model(tmp, vocab_path=vocab_path, seed=seed, **STANDARD_MODELS[name])
            tmp.rename(path)
        out[name] = path
    return out
