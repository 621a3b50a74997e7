"""The tiny model generator: deterministic, readable by gguf, the intended tensors, types and sizes.

Most tests use the synthetic vocabulary of ``write_test_vocab``, so they run without any upstream install; those on
upstream's own vocabulary or programs skip with one line when no peer is installed.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.models import (
    FILE_TYPES,
    HASH_MIN_SIZE,
    STANDARD_MODELS,
    ensure_models,
    write_model,
    write_test_vocab,
)

SMALL = {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_head_kv": 2, "n_ff": 128}
N_TENSORS = 3 + 9 * SMALL["n_layer"]  # token_embd, output_norm, output + 9 per block


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """261 tokens: models of a few hundred KB."""
    return write_test_vocab(tmp_path_factory.mktemp("vocab") / "vocab.gguf")


@pytest.fixture(scope="module")
def full_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32,000 tokens like upstream's vocabulary, so that the standard models have their real sizes."""
    return write_test_vocab(tmp_path_factory.mktemp("vocab") / "vocab32k.gguf", 32000)


@pytest.fixture(scope="module")
def upstream_vocab() -> Path:
    from ggml_rpc.conformance.upstream.peers import installed_peers

    for peer in installed_peers():
        # upstream's own file only (a wheel peer without a 6/7 build beside it has a synthetic one)
        if peer.vocab.is_file() and peer.vocab.name == "ggml-vocab-llama-spm.gguf":
            return peer.vocab
    pytest.skip("no installed upstream peer with ggml-vocab-llama-spm.gguf (`ggml-rpc upstream install`)")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read(path: Path):
    from gguf import GGUFReader

    return GGUFReader(path)


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path, vocab: Path, ftype: str) -> None:
    a = write_model(tmp_path / "a.gguf", ftype=ftype, vocab_path=vocab, seed=3, **SMALL)
    write_model(tmp_path / "b.gguf", ftype=ftype, vocab_path=vocab, seed=3, **SMALL)
    write_model(tmp_path / "c.gguf", ftype=ftype, vocab_path=vocab, seed=4, **SMALL)
    assert _sha(tmp_path / "a.gguf") == _sha(tmp_path / "b.gguf") != _sha(tmp_path / "c.gguf")
    assert a.ftype == ftype and a.path == tmp_path / "a.gguf"


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
def test_model_reads_back_with_the_llama_tensors_types_and_shapes(tmp_path: Path, vocab: Path, ftype: str) -> None:
    info = write_model(tmp_path / "m.gguf", ftype=ftype, vocab_path=vocab, **SMALL)
    r = _read(tmp_path / "m.gguf")
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == N_TENSORS and list(tensors) == list(info.tensor_bytes)
    for name, t in tensors.items():
        # Norms stay F32; a Q4_0 model's output is Q8_0, as llama-quantize leaves it at this width.
        want = "F32" if name.endswith("norm.weight") else "Q8_0" if (name, ftype) == ("output.weight", "Q4_0") \
            else ftype
        assert t.tensor_type.name == want == info.tensor_types[name], name
        assert int(t.n_bytes) == info.tensor_bytes[name], name
    shapes = {name: [int(x) for x in t.shape] for name, t in tensors.items()}  # ggml order: ne0 first
    assert shapes["token_embd.weight"] == shapes["output.weight"] == [64, 261]
    assert shapes["blk.1.attn_q.weight"] == shapes["blk.1.attn_output.weight"] == [64, 64]
    assert shapes["blk.0.ffn_up.weight"] == shapes["blk.0.ffn_gate.weight"] == [64, 128]
    assert shapes["blk.0.ffn_down.weight"] == [128, 64] and shapes["output_norm.weight"] == [64]
    assert np.all(np.asarray(tensors["output_norm.weight"].data) == 1.0)

    f = r.fields
    assert f["general.architecture"].contents() == "llama"
    assert f["general.file_type"].contents() == FILE_TYPES[ftype]
    assert ("general.quantization_version" in f) == ftype.startswith("Q")
    assert f["llama.embedding_length"].contents() == 64 and f["llama.block_count"].contents() == 2
    assert f["llama.attention.head_count_kv"].contents() == 2 and f["llama.vocab_size"].contents() == 261


def test_every_tokenizer_key_is_copied_with_its_type(tmp_path: Path, vocab: Path) -> None:
    write_model(tmp_path / "m.gguf", ftype="F16", vocab_path=vocab, **SMALL)
    src, out = _read(vocab).fields, _read(tmp_path / "m.gguf").fields
    keys = sorted(k for k in src if k.startswith("tokenizer."))
    assert "tokenizer.ggml.scores" in keys and keys == sorted(k for k in out if k.startswith("tokenizer."))
    for key in keys:
        assert out[key].types == src[key].types and out[key].contents() == src[key].contents(), key


def test_quantised_weights_approximate_the_f32_model_of_the_same_seed(tmp_path: Path, vocab: Path) -> None:
    from gguf.quants import dequantize

    def weight(ftype: str) -> np.ndarray:
        write_model(tmp_path / f"{ftype}.gguf", ftype=ftype, vocab_path=vocab, seed=7, **SMALL)
        t = next(t for t in _read(tmp_path / f"{ftype}.gguf").tensors if t.name == "blk.0.ffn_down.weight")
        return dequantize(np.asarray(t.data), t.tensor_type).reshape(64, 128)

    exact = weight("F32")
    assert 0.015 < float(exact.std()) < 0.025  # normal x 0.02: numerically tame
    for ftype, tolerance in (("F16", 1e-4), ("Q8_0", 1e-3), ("Q4_0", 1e-2)):
        assert float(np.abs(weight(ftype) - exact).max()) < tolerance, ftype


def test_standard_models_sizes_and_the_one_tensor_above_the_hash_threshold(tmp_path: Path, full_vocab: Path) -> None:
    infos = {name: write_model(tmp_path / f"{name}.gguf", vocab_path=full_vocab, **params)
             for name, params in STANDARD_MODELS.items()}
    for name, info in infos.items():
        assert info.above_hash_threshold == (["output.weight"] if name == "tiny-f32-big" else []), name
        assert info.path.stat().st_size < 24 * 1024 * 1024, name
        assert info.path.stat().st_size - info.total_tensor_bytes < 1024 * 1024, name  # the rest is the vocabulary
    sizes = [infos[name].path.stat().st_size for name in ("tiny-q4_0", "tiny-q8_0", "tiny-f16", "tiny-f32")]
    assert sizes == sorted(sizes)
    # Read back, not just as recorded: the file's only tensor above 10 MiB, token_embd F16 below it.
    big = {t.name: t for t in _read(infos["tiny-f32-big"].path).tensors}
    assert [name for name, t in big.items() if int(t.n_bytes) > HASH_MIN_SIZE] == ["output.weight"]
    assert big["token_embd.weight"].tensor_type.name == "F16"
    # ensure_models writes the very same bytes as write_model with the standard parameters.
    ensured = ensure_models(tmp_path / "ensured", full_vocab, ["tiny-f32-big"])["tiny-f32-big"]
    assert _sha(ensured) == _sha(infos["tiny-f32-big"].path)


def test_ensure_models_is_idempotent_and_leaves_no_temporary_files(tmp_path: Path, vocab: Path) -> None:
    first = ensure_models(tmp_path, vocab, ["tiny-q8_0", "tiny-f16"])
    stamps = {name: p.stat().st_mtime_ns for name, p in first.items()}
    again = ensure_models(tmp_path, vocab, ["tiny-q8_0", "tiny-f16"])
    assert again == first and {name: p.stat().st_mtime_ns for name, p in again.items()} == stamps
    other_seed = ensure_models(tmp_path, vocab, ["tiny-q8_0"], seed=1)
    assert other_seed["tiny-q8_0"] != first["tiny-q8_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in [*first.values(), *other_seed.values()])


def test_unsupported_types_are_refused(tmp_path: Path, vocab: Path) -> None:
    with pytest.raises(ValueError, match="unsupported ftype"):
        write_model(tmp_path / "m.gguf", ftype="Q6_K", vocab_path=vocab)
    with pytest.raises(ValueError, match="multiples of 32"):
        write_model(tmp_path / "m.gguf", ftype="Q4_0", vocab_path=vocab, n_embd=48, n_head=2)


def test_upstream_vocabulary_is_copied_whole(tmp_path: Path, upstream_vocab: Path) -> None:
    info = write_model(tmp_path / "m.gguf", ftype="Q4_0", vocab_path=upstream_vocab)
    src, out = _read(upstream_vocab).fields, _read(info.path).fields
    assert len(out["tokenizer.ggml.tokens"].data) == out["llama.vocab_size"].contents() == 32000
    for key in (k for k in src if k.startswith("tokenizer.")):
        assert out[key].types == src[key].types and out[key].contents() == src[key].contents(), key


@pytest.mark.upstream
def test_every_standard_model_generates_in_upstream_llama_completion(upstream_peer, tmp_path: Path) -> None:
    from ggml_rpc.conformance.upstream.runs import N_PREDICT, completion

    for name, path in ensure_models(tmp_path, upstream_peer.vocab).items():
        done = completion(upstream_peer, path, None)
        assert done.ok, f"{name}: {done.why()}"
        # The first new token comes from the prompt's evaluation; each further one is one "run".
        runs = re.search(r"\beval time =.*?/\s*(\d+) runs", done.stderr)
        assert runs and int(runs.group(1)) == N_PREDICT - 1, f"{name}: {runs and runs.group(0)}"
        assert done.stdout.strip().startswith("Hello world"), name
