"""The model zoo: its list, the architectures the writer makes, and models made by upstream's own quantiser.

The list and the writer are tested without any upstream install (synthetic vocabulary); the tests marked
``upstream`` run the installed peer's ``llama-quantize`` and ``llama-imatrix``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.gguf_tensors import tensor_infos
from ggml_rpc.conformance.upstream.models import ARCHITECTURES, write_model, write_test_vocab
from ggml_rpc.conformance.upstream.zoo import (
    CI_ZOO,
    FILE_TYPES,
    IMATRIX_TYPES,
    MOE_TYPES,
    NOT_MADE,
    SHAPES,
    ZOO,
    ensure_zoo,
    imatrix_text,
    offered_file_types,
    quantizer_for,
    zoo_option,
)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_vocab(tmp_path_factory.mktemp("vocab") / "vocab.gguf")


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    # The kit's own reader: gguf's does not know every type llama-quantize writes (Q2_0).
    return {t.name: (t.type_name, t.ne) for t in tensor_infos(path)}


def test_zoo_list_is_consistent():
    assert len(ZOO) == len({m.name for m in ZOO.values()})
    assert all(m.shape in SHAPES for m in ZOO.values())
    assert set(CI_ZOO) <= set(ZOO)
    # Every file type the zoo knows is made at least once; the MoE-only types only for a mixture of experts.
    made = {m.ftype for m in ZOO.values()}
    assert set(FILE_TYPES) | set(IMATRIX_TYPES) | set(MOE_TYPES) <= made
    assert all(SHAPES[m.shape].get("n_expert") for m in ZOO.values() if m.ftype in MOE_TYPES)
    assert {m.imatrix for m in ZOO.values() if m.ftype in IMATRIX_TYPES} == {True}
    # Shapes the issue asks for: 1 and 2 key/value heads, widths 96 to 512, the other architectures.
    assert {s["n_head_kv"] for s in SHAPES.values()} >= {1, 2}
    assert {s["n_embd"] for s in SHAPES.values()} >= {96, 128, 256, 512}
    assert {s.get("arch", "llama") for s in SHAPES.values()} == set(ARCHITECTURES)


def test_zoo_option():
    assert zoo_option("ci") == list(CI_ZOO)
    assert zoo_option("all") == list(ZOO)
    assert zoo_option("none") == []
    assert zoo_option("zoo-q4_k_m, zoo-iq2_xs") == ["zoo-q4_k_m", "zoo-iq2_xs"]
    with pytest.raises(ValueError, match="unknown zoo model 'zoo-nope'"):
        zoo_option("zoo-q4_k_m,zoo-nope")


def test_imatrix_text_is_fixed():
    assert imatrix_text() == imatrix_text()
    assert len(imatrix_text().split()) == 3000


@pytest.mark.parametrize("shape", ["qwen2", "qwen3", "gemma", "moe"])
def test_each_architecture_has_its_own_tensors(tmp_path: Path, vocab: Path, shape: str):
    params = {**SHAPES[shape], "n_embd": 64, "n_ff": 64 if shape == "moe" else 128}
    write_model(tmp_path / "m.gguf", ftype="F32", vocab_path=vocab, **params)
    tensors = _tensors(tmp_path / "m.gguf")
    head_dim = 64 // params["n_head"]
    kv = params["n_head_kv"] * head_dim
    if shape == "qwen2":
        assert tensors["blk.0.attn_q.bias"] == ("F32", (64,)) and tensors["blk.1.attn_k.bias"] == ("F32", (kv,))
    if shape == "qwen3":
        assert tensors["blk.0.attn_q_norm.weight"] == ("F32", (head_dim,))
        assert tensors["blk.1.attn_k_norm.weight"] == ("F32", (head_dim,))
    if shape == "gemma":
        assert "output.weight" not in tensors  # tied to token_embd
    if shape == "moe":
        n_expert = params["n_expert"]
        assert "blk.0.ffn_gate.weight" not in tensors
        assert tensors["blk.0.ffn_gate_inp.weight"] == ("F32", (64, n_expert))
        assert tensors["blk.0.ffn_up_exps.weight"] == ("F32", (64, 64, n_expert))
        assert tensors["blk.1.ffn_down_exps.weight"] == ("F32", (64, 64, n_expert))
    else:
        assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= set(tensors)
    assert tensors["blk.0.attn_k.weight"] == ("F32", (64, kv))


def test_mamba_has_upstreams_recurrent_layer(tmp_path: Path, vocab: Path):
    write_model(tmp_path / "m.gguf", ftype="F32", vocab_path=vocab, **{**SHAPES["mamba"], "n_embd": 64})
    tensors = _tensors(tmp_path / "m.gguf")
    # upstream's loader: d_inner = 2 n_embd (128), d_conv 4, d_state 16, dt_rank ceil(64 / 16) = 4.
    assert tensors["blk.0.ssm_in.weight"] == ("F32", (64, 256))
    assert tensors["blk.0.ssm_conv1d.weight"] == ("F32", (4, 128))
    assert tensors["blk.0.ssm_x.weight"] == ("F32", (128, 4 + 2 * 16))
    assert tensors["blk.1.ssm_dt.weight"] == ("F32", (4, 128))
    assert tensors["blk.1.ssm_a"] == ("F32", (16, 128))
    assert tensors["blk.1.ssm_out.weight"] == ("F32", (128, 64))
    assert not any(".attn_q" in name or ".ffn_" in name for name in tensors)
    from gguf import GGUFReader

    reader = GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["mamba.ssm.inner_size"].contents() == 128
    assert reader.fields["mamba.ssm.time_step_rank"].contents() == 4
    (a,) = (t.data for t in reader.tensors if t.name == "blk.0.ssm_a")
    assert float(np.max(a)) < 0  # a stable state: every A negative


def test_phi3_has_fused_matrices_and_a_name_upstreams_vocabulary_loader_takes(tmp_path: Path, vocab: Path):
    write_model(tmp_path / "m.gguf", ftype="F32", vocab_path=vocab, **{**SHAPES["phi3"], "n_embd": 64, "n_ff": 96})
    tensors = _tensors(tmp_path / "m.gguf")
    kv = SHAPES["phi3"]["n_head_kv"] * 64 // SHAPES["phi3"]["n_head"]
    assert tensors["blk.0.attn_qkv.weight"] == ("F32", (64, 64 + 2 * kv))
    assert tensors["blk.1.ffn_up.weight"] == ("F32", (64, 2 * 96))
    assert not any(n.endswith(("attn_q.weight", "attn_k.weight", "ffn_gate.weight")) for n in tensors)
    from gguf import GGUFReader

    # A name containing "phi3" makes upstream's loader look for Phi-3's own tokens, absent from a llama vocabulary.
    name = GGUFReader(tmp_path / "m.gguf").fields["general.name"].contents().lower()
    assert "phi3" not in name and "phi-3" not in name


def test_unknown_architecture_and_experts_outside_llama_are_refused(tmp_path: Path, vocab: Path):
    with pytest.raises(ValueError, match="unsupported architecture"):
        write_model(tmp_path / "m.gguf", ftype="F32", vocab_path=vocab, arch="rwkv6")
    with pytest.raises(ValueError, match="experts need the llama architecture"):
        write_model(tmp_path / "m.gguf", ftype="F32", vocab_path=vocab, arch="qwen2", n_expert=4, n_expert_used=2)


@pytest.mark.upstream
def test_the_zoo_covers_every_file_type_upstreams_quantiser_offers(upstream_peer):
    offered = set(offered_file_types(upstream_peer))
    assert {"Q4_K_M", "IQ2_XS", "TQ1_0"} <= offered  # the help was read
    made = set(FILE_TYPES) | set(IMATRIX_TYPES) | set(MOE_TYPES)
    assert offered - set(NOT_MADE) <= made, f"not in the zoo: {sorted(offered - set(NOT_MADE) - made)}"


@pytest.mark.upstream
def test_zoo_models_are_upstreams_mixes_and_made_once(upstream_peer, tmp_path: Path):
    assert quantizer_for(upstream_peer) is upstream_peer
    first = ensure_zoo(tmp_path, upstream_peer, ["zoo-e128-kv1-q4_0", "zoo-iq2_xs"])
    stamps = {name: path.stat().st_mtime_ns for name, path in first.items()}
    q4_0 = _tensors(first["zoo-e128-kv1-q4_0"])
    # llama-quantize's own mix: Q4_0 layers, and an output that wanted Q6_K but has rows of 128, so Q8_0.
    assert q4_0["blk.0.attn_q.weight"][0] == "Q4_0" and q4_0["output.weight"][0] == "Q8_0"
    iq2 = _tensors(first["zoo-iq2_xs"])
    assert "IQ2_XS" in {kind for kind, _ in iq2.values()}
    assert list(tmp_path.glob("imatrix-e256-kv2-*.gguf")), "IQ2_XS was made without an importance matrix"
    again = ensure_zoo(tmp_path, upstream_peer, ["zoo-e128-kv1-q4_0", "zoo-iq2_xs"])
    assert again == first and {n: p.stat().st_mtime_ns for n, p in again.items()} == stamps
    assert not list(tmp_path.glob(".*.tmp*"))
    assert np.all([p.stat().st_size > 0 for p in again.values()])
