"""IQ1_S/M, IQ2_XXS/XS/S and IQ3_XXS/S: the codebook file's format and search, the refusal without codebooks, and
(with the upstream peers installed) the executor's dequantisation against upstream's own ``to_float``, bit for bit,
on thousands of random blocks, plus MUL_MAT and GET_ROWS of such weights."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.upstream import codebooks as cb
from ggml_rpc.conformance.upstream.ggml_lib import GgmlLibrary
from ggml_rpc.reference import running_server
from ggml_rpc.reference.executor import ExecutorError, execute, grids, supports_op
from ggml_rpc.reference.executor import types as ty
from ggml_rpc.reference.executor.arena import Arena
from ggml_rpc.spec import TYPES, GgmlOp, GgmlType, make_tensor

F32, I32 = int(GgmlType.F32), int(GgmlType.I32)
GRID_TYPES = grids.GRID_TYPES


def random_blocks(t: int, n: int, seed: int) -> np.ndarray:
    """``n`` blocks of random bytes whose f16 scale is finite (IQ1_M spreads its scale over the scale words)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, TYPES[t].size), dtype=np.uint8)
    d = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 3, n)).astype("<f2")
    if t == grids.IQ1_M:
        words = np.ascontiguousarray(b[:, -8:]).view("<u2")
        nibbles = (d.view("<u2")[:, None] >> (4 * np.arange(4, dtype=np.uint16))) & 0xF
        b[:, -8:] = ((words & 0x0FFF) | (nibbles << 12)).astype("<u2").view(np.uint8)
    else:
        b[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    return b


def synthetic_tables() -> dict[str, np.ndarray]:
    return {name: np.zeros((g.entries, g.width), dtype=g.dtype) for name, g in grids.CODEBOOKS.items()}


@pytest.fixture
def no_codebooks(monkeypatch):
    """The executor as on a machine without an upstream build."""
    monkeypatch.setenv(cb.ENV, "off")
    grids.codebooks.cache_clear()
    yield
    monkeypatch.undo()
    grids.codebooks.cache_clear()


def test_ksigns_have_an_even_number_of_minus_signs():
    bits = np.unpackbits(grids.KSIGNS[:, None], axis=1)
    assert np.all(bits.sum(axis=1) % 2 == 0)
    assert np.array_equal(grids.KSIGNS & 127, np.arange(128))


def test_codebook_file_round_trip_and_malformed_files(tmp_path):
    path = tmp_path / "codebooks.npz"
    tables = synthetic_tables()
    cb.save(path, tables, {"peer": "test"})
    loaded, source = cb.load(path)
    assert source == {"format": cb.FORMAT, "peer": "test"}
    assert all(np.array_equal(loaded[k], tables[k]) and loaded[k].dtype == tables[k].dtype for k in tables)
    assert cb.load(tmp_path / "missing.npz") is None
    tables["iq3s_grid"] = tables["iq3s_grid"][:10]
    cb.save(path, tables, {"peer": "test"})
    assert cb.load(path) is None


def test_the_environment_names_the_file_or_turns_codebooks_off(tmp_path, monkeypatch):
    path = tmp_path / "cb.npz"
    cb.save(path, synthetic_tables(), {"peer": "test"})
    monkeypatch.setenv(cb.ENV, str(path))
    assert cb.find()[1]["peer"] == "test"
    monkeypatch.setenv(cb.ENV, "off")
    assert cb.find() is None


def test_codebooks_command_without_peers_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    assert main(["upstream", "codebooks", "--proto", "7"]) == 0
    assert "7.0.0: not installed (ggml-rpc upstream install --proto 7)" in capsys.readouterr().out
    monkeypatch.delenv(cb.ENV, raising=False)
    assert cb.find() is None


@pytest.mark.parametrize("t", GRID_TYPES)
def test_without_codebooks_the_type_is_refused_clearly(no_codebooks, t):
    arena = Arena(1 << 16)
    w = arena.tensor(t, (256, 2))
    x = arena.tensor(F32, (256, 3))
    mm = arena.tensor(F32, (2, 3), op=GgmlOp.MUL_MAT, src=(w, x))
    assert not grids.available(t)
    assert not supports_op(mm)
    assert supports_op(arena.tensor(F32, (2, 3), op=GgmlOp.MUL_MAT, src=(arena.tensor(ty.Q4_K, (256, 2)), x)))
    with pytest.raises(ExecutorError, match=f"{TYPES[t].name} needs the IQ codebooks.*ggml-rpc upstream install"):
        execute([mm])
    with pytest.raises(ExecutorError, match="needs the IQ codebooks"):
        ty.dequantize(t, np.zeros((1, TYPES[t].size), np.uint8))


# ---- against upstream ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(upstream_peer) -> GgmlLibrary:
    return GgmlLibrary(upstream_peer.bin_dir)


@pytest.fixture(scope="module")
def loaded(upstream_peer) -> dict[str, np.ndarray]:
    grids.use_codebooks(cb.tables)  # as `ggml-rpc serve` configures its server
    grids.codebooks.cache_clear()
    tables = grids.codebooks()
    assert tables is not None, "upstream is installed but the executor found no codebooks"
    return tables


@pytest.mark.upstream
def test_an_installed_peer_without_the_file_gets_it_on_first_use(upstream_peer, monkeypatch, tmp_path, capsys):
    # A copy of the peer's layout in a cache of the test's own: the build linked, its record copied, no codebooks.
    prefix = tmp_path / upstream_peer.version
    prefix.mkdir()
    (prefix / "site").symlink_to(upstream_peer.prefix / "site")
    shutil.copy(upstream_peer.record, prefix / "peer.json")
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    monkeypatch.delenv(cb.ENV, raising=False)
    grids.use_codebooks(cb.tables)
    grids.codebooks.cache_clear()
    try:
        assert grids.available(grids.IQ2_XXS)
    finally:
        grids.codebooks.cache_clear()
    _, source = cb.load(prefix / cb.FILE_NAME)
    assert source["peer"] == upstream_peer.version and source["package"] == upstream_peer.info()["package"]
    assert main(["upstream", "codebooks", "--proto", upstream_peer.version[0], "--force"]) == 0
    assert f"{prefix / cb.FILE_NAME} (from {source['package']}" in capsys.readouterr().out


@pytest.mark.upstream
def test_extraction_reads_the_same_tables_as_the_executor_loaded(upstream_peer, loaded):
    fresh = cb.extract(upstream_peer.bin_dir)
    assert fresh.keys() == loaded.keys()
    for name, g in grids.CODEBOOKS.items():
        assert fresh[name].shape == (g.entries, g.width)
        assert np.array_equal(fresh[name], loaded[name])
        # A codebook lists each lattice point once.
        assert len({row.tobytes() for row in fresh[name]}) == g.entries


@pytest.mark.upstream
@pytest.mark.parametrize("t", GRID_TYPES)
def test_dequantisation_matches_ggml_bit_for_bit(oracle, loaded, t):
    blocks = random_blocks(t, 3000, seed=t)
    ours = ty.dequantize(t, blocks[None])
    theirs = oracle.to_float(t, blocks)
    assert np.array_equal(ours.reshape(-1).view(np.uint32), theirs.view(np.uint32))


@pytest.mark.upstream
@pytest.mark.parametrize("t", GRID_TYPES)
def test_mul_mat_and_get_rows_read_grid_weights(loaded, t):
    arena = Arena(1 << 18)
    k, m, n = 512, 4, 3
    w = arena.tensor(t, (k, m))
    arena.raw(w)[...] = random_blocks(t, m * k // 256, seed=100 + t).reshape(arena.raw(w).shape)
    weights = ty.dequantize(t, arena.raw(w))[0, 0]  # (m, k)
    x = arena.tensor(F32, (k, n))
    xs = np.random.default_rng(t).standard_normal((n, k)).astype(np.float32)
    arena.set(x, xs)
    mm = arena.tensor(F32, (m, n), op=GgmlOp.MUL_MAT, src=(w, x))
    idx = arena.tensor(I32, (2,))
    arena.set_raw(idx, np.array([3, 1], dtype=np.int32))
    rows = arena.tensor(F32, (k, 2), op=GgmlOp.GET_ROWS, src=(w, idx))
    assert supports_op(mm) and supports_op(rows)
    execute([mm, rows])
    # ggml dots the weights with src1 rounded through Q8_K (the grid types' vec-dot type).
    want = ty.through_type(ty.Q8_K, xs) @ weights.T
    np.testing.assert_allclose(arena.get(mm)[0, 0], want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    assert np.array_equal(arena.get(rows)[0, 0], weights[[3, 1]])


@pytest.mark.upstream
@pytest.mark.parametrize("t", GRID_TYPES)
def test_vec_dot_type_is_upstreams(oracle, t):
    assert oracle.vec_dot_type(t) == ty.VEC_DOT_TYPE[t] == ty.Q8_K


def _server_supports_grid_mul_mat() -> list[bool]:
    """What a 7.0.1 reference server answers GET_DEVICE_SUPPORTS_OP for MUL_MAT of each grid type's weights."""
    with running_server("7.0.1") as srv, RpcClient.connect(srv.host, srv.port, timeout=10.0) as c:
        x = make_tensor(id=2, ne=(256, 3))
        answers = []
        for t in GRID_TYPES:
            w = make_tensor(id=1, type=t, ne=(256, 2))
            answers.append(c.supports_op(0, make_tensor(id=3, ne=(2, 3), op=GgmlOp.MUL_MAT, src=[1, 2]), [w, x]))
        return answers


def test_a_701_server_without_codebooks_answers_no(no_codebooks):
    assert _server_supports_grid_mul_mat() == [False] * len(GRID_TYPES)


@pytest.mark.upstream
def test_a_701_server_with_codebooks_answers_yes(loaded):
    assert _server_supports_grid_mul_mat() == [True] * len(GRID_TYPES)
