"""The tiny model generator: deterministic, readable by gguf, the intended tensors, types and sizes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.models import HASH_MIN_SIZE, STANDARD_MODELS, write_model


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    """A small SentencePiece-style vocabulary file (256 byte tokens plus specials), as upstream's has the keys."""
    from gguf import GGUFWriter

    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    w = GGUFWriter(str(path), "llama")
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{i:02X}>" for i in range(256)], "\u2581Hello", "\u2581world"]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3, *[6] * 256, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("ftype", ["F32", "F16", "Q8_0", "Q4_0"])
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, vocab, ftype) -> None:
    a = write_model(tmp_path / "a.gguf", ftype=ftype, vocab_path=vocab, seed=3)
    write_model(tmp_path / "b.gguf", ftype=ftype, vocab_path=vocab, seed=3)
    write_model(tmp_path / "c.gguf", ftype=ftype, vocab_path=vocab, seed=4)
    assert _sha(tmp_path / "a.gguf") == _sha(tmp_path / "b.gguf") != _sha(tmp_path / "c.gguf")
    assert a.ftype == ftype


def test_model_reads_back_with_llama_tensors_and_types(tmp_path, vocab) -> None:
    from gguf import GGMLQuantizationType, GGUFReader

    write_model(tmp_path / "m.gguf", ftype="Q4_0", vocab_path=vocab, n_layer=2, n_embd=64, n_ff=128)
    r = GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type for t in r.tensors}
    assert len(types) == 3 + 9 * 2
    assert types["blk.1.ffn_down.weight"] == GGMLQuantizationType.Q4_0
    assert types["output.weight"] == GGMLQuantizationType.Q8_0  # as llama-quantize leaves a Q4_0 model's output
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    assert shapes["token_embd.weight"] == [64, 261] and shapes["blk.0.ffn_up.weight"] == [64, 128]
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "llama"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 261
    norm = next(t for t in r.tensors if t.name == "output_norm.weight")
    assert np.all(np.asarray(norm.data) == 1.0)


def test_only_the_big_model_has_an_offloaded_weight_above_the_hash_threshold() -> None:
    n_vocab = 32000  # upstream's ggml-vocab-llama-spm.gguf
    for name, params in STANDARD_MODELS.items():
        output_bytes = n_vocab * params["n_embd"] * {"F32": 4, "F16": 2, "Q8_0": 34 / 32, "Q4_0": 34 / 32}[
            params["ftype"]]
        assert (output_bytes > HASH_MIN_SIZE) == (name == "tiny-f32-big"), name
        assert output_bytes < 16 * 1024 * 1024
