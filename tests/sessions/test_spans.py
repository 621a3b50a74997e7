"""Lazy capture data: streams of file and memory pieces read in windows, LazyBytes ranges, FNV-1a piece by piece."""

from __future__ import annotations

import os
import random

from ggml_rpc.conformance.sessions.spans import CaptureFile, LazyBytes, Stream, as_buffer
from ggml_rpc.spec import fnv1a64
from ggml_rpc.spec.facts import FNV_OFFSET_BASIS, fnv1a64_continue


def test_fnv1a64_continues_from_any_state():
    rng = random.Random(5)
    for _ in range(100):
        data = os.urandom(rng.randint(0, 4000))
        cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 6))))
        state, prev = FNV_OFFSET_BASIS, 0
        for cut in [*cuts, len(data)]:
            state = fnv1a64_continue(state, data[prev:cut])
            prev = cut
        assert state == fnv1a64(data)


def _stream(tmp_path, data: bytes) -> Stream:
    """``data`` as a stream of uneven file pieces (with foreign bytes between them) and one memory piece."""
    path = tmp_path / "f.bin"
    stream = Stream(None)
    blob, at, rng = bytearray(), 0, random.Random(1)
    layout = []
    while at < len(data):
        n = min(rng.randint(1, 3000), len(data) - at)
        blob += b"\xee" * rng.randint(0, 50)
        layout.append((len(blob), at, n))
        blob += data[at : at + n]
        at += n
    path.write_bytes(bytes(blob))
    stream.file = CaptureFile(path)
    for i, (off, start, n) in enumerate(layout):
        if i == 3:
            stream.add_memory(data[start : start + n])
        else:
            stream.add_file(off, n)
    return stream


def test_stream_windows_and_lazy_ranges(tmp_path):
    data = os.urandom(50_000)
    stream = _stream(tmp_path, data)
    assert stream.size == len(data) and stream.read(0, len(data)) == data
    for window in (1, 7, 4096, 1 << 20):
        assert b"".join(b"".join(v) for v in stream.windows(123, 40_000, window)) == data[123:40_000]
        assert all(sum(v.nbytes for v in views) <= window for views in stream.windows(0, None, window))
    lazy = stream.view(1000, 30_000)
    assert isinstance(lazy, LazyBytes) and lazy.nbytes == len(lazy) == 29_000
    assert bytes(lazy) == data[1000:30_000] == as_buffer(lazy)
    assert bytes(lazy[:16]) == data[1000:1016] and lazy[5] == data[1005] and lazy[-1] == data[29_999]
    assert lazy == data[1000:30_000] and lazy != data[1000:30_001] and lazy == stream.view(1000, 30_000)
    assert b"".join(lazy.slices(4096)) == data[1000:30_000]
    assert all(s.nbytes == 4096 for s in list(lazy.slices(4096))[:-1])
    assert bytes(lazy.sub(10, 20)) == data[1010:1020]
    assert fnv1a64(lazy) == fnv1a64(data[1000:30_000])


def test_in_memory_streams_give_memoryviews():
    stream = Stream.from_bytes(b"abcdef")
    view = stream.view(1, 4)
    assert isinstance(view, memoryview) and bytes(view) == b"bcd"


def test_read_comparison_in_slices_matches_the_whole():
    """compare.py's sliced read comparison gives the whole-buffer first difference and NMSE."""
    import numpy as np
    from ggml_rpc.conformance.nmse import nmse
    from ggml_rpc.conformance.sessions.compare import _ReadDiff, _slices, first_difference

    rng = np.random.default_rng(3)
    want = rng.standard_normal(300_000).astype(np.float32)
    got = want.copy()
    got[1000:1100] += 1e-3
    got[250_000] = 7.0
    diff = _ReadDiff(np.dtype("<f4"))
    for a, b in zip(_slices(memoryview(want.tobytes()), 65_536), _slices(memoryview(got.tobytes()), 65_536),
                    strict=True):
        diff.add(a, b)
    assert diff.first_difference() == first_difference(memoryview(want.tobytes()), memoryview(got.tobytes()))
    assert abs(diff.nmse() - nmse(want, got)) <= 1e-12 * nmse(want, got)
    got[5] = np.nan
    diff = _ReadDiff(np.dtype("<f4"))
    diff.add(memoryview(want.tobytes()), memoryview(got.tobytes()))
    assert diff.nmse() == float("inf") == nmse(want, got)
