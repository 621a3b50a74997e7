"""The kit's own GGUF tensor table agrees with gguf's reader, and fails cleanly on a file that is not one."""

from __future__ import annotations

from pathlib import Path

import pytest
from ggml_rpc.conformance.upstream.gguf_tensors import tensor_infos
from ggml_rpc.conformance.upstream.models import write_model, write_test_vocab


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    vocab = write_test_vocab(folder / "vocab.gguf")
    return write_model(folder / "m.gguf", ftype="Q4_0", vocab_path=vocab, token_embd_ftype="F16").path


def test_tensor_table_matches_gguf(model: Path):
    from gguf import GGUFReader

    theirs = [(t.name, t.tensor_type.name, int(t.n_bytes), tuple(int(n) for n in t.shape))
              for t in GGUFReader(model).tensors]
    mine = [(t.name, t.type_name, t.nbytes, t.ne) for t in tensor_infos(model)]
    assert mine == theirs and len(mine) > 10


def test_not_a_gguf_file_and_a_truncated_one_are_refused(tmp_path: Path, model: Path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        tensor_infos(tmp_path / "x.gguf")
    (tmp_path / "cut.gguf").write_bytes(model.read_bytes()[:2000])
    with pytest.raises(ValueError, match="ends early"):
        tensor_infos(tmp_path / "cut.gguf")
