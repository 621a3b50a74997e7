"""TOP_K's order among ties is the C++ standard library's partial sort's: checked against std::partial_sort itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.reference.executor.partial_sort import top_k_rows

# The oracle is the library upstream is built with, compiled here: ggml's comparator ("greater value first") over
# the indices 0..n-1 of each row, read from stdin as "n k" then n floats.
ORACLE = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
    int rows, n, k;
    if (std::scanf("%d %d %d", &rows, &n, &k) != 3) return 1;
    std::vector<float> x(n);
    std::vector<int> idx(n);
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < n; j++) if (std::scanf("%a", &x[j]) != 1) return 1;
        for (int j = 0; j < n; j++) idx[j] = j;
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                          [&](int a, int b) { return x[a] > x[b]; });
        for (int j = 0; j < k; j++) std::printf("%d ", idx[j]);
        std::printf("\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not installed (the oracle is the C++ standard library's partial_sort)")
    d = tmp_path_factory.mktemp("partial_sort")
    (d / "oracle.cpp").write_text(ORACLE)
    subprocess.run([cxx, "-O1", "-o", str(d / "oracle"), str(d / "oracle.cpp")], check=True, timeout=120)
    return d / "oracle"


def _std(oracle: Path, x: np.ndarray, k: int) -> np.ndarray:
    lines = [f"{x.shape[0]} {x.shape[1]} {k}"] + [" ".join(float(v).hex() for v in row) for row in x]
    out = subprocess.run([str(oracle)], input="\n".join(lines), capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return np.array([[int(t) for t in line.split()] for line in out.splitlines()], dtype=np.int32)


@pytest.mark.parametrize(("n", "k", "levels"), [(6, 2, 2), (17, 5, 3), (100, 1, 4), (100, 37, 5), (257, 256, 7),
                                                (1000, 40, 10), (64, 64, 1), (33, 8, 33)])
def test_same_order_as_std_partial_sort(oracle: Path, n: int, k: int, levels: int) -> None:
    # Few distinct values, so that most positions are decided by how the heap leaves ties.
    rng = np.random.default_rng(n * 1000 + k)
    x = rng.integers(0, levels, size=(12, n)).astype(np.float32) - levels / 2
    x[3] = -0.0  # -0 and +0 compare equal
    x[4, ::3] = 0.0
    got = np.empty((x.shape[0], k), dtype=np.int32)
    top_k_rows(x, k, got)
    want = _std(oracle, x, k)
    np.testing.assert_array_equal(got, want)
    # Not the stable order: these rows are there to tell the two apart.
    if levels < n // 2 and k > 2:
        stable = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        assert not np.array_equal(got, stable)


def test_distinct_values_are_the_k_largest_largest_first() -> None:
    x = np.random.default_rng(1).permutation(5000).astype(np.float32)[None, :]
    got = np.empty((1, 50), dtype=np.int32)
    top_k_rows(x, 50, got)
    np.testing.assert_array_equal(got[0], np.argsort(-x[0])[:50])
