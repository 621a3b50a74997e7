"""A hash-cache entry verified once is read straight into the tensor afterwards, but only while its file is the
very file that was verified: a changed, truncated, replaced or extended file is verified again (and a corrupt one
never served).  Every change below alters the file's identity deterministically (size, inode or mtime)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.reference import cache as cache_mod
from ggml_rpc.reference.cache import HashCache
from ggml_rpc.spec import cache_file_name, fnv1a64

SIZE = 1 << 16


def _entry(tmp_path: Path, seed: int = 1) -> tuple[HashCache, int, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    cache = HashCache(tmp_path)
    assert cache.save(data) == fnv1a64(data)
    return cache, fnv1a64(data), data


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files count as settled at once (their identity may be trusted right after the first verification)."""
    monkeypatch.setattr(cache_mod, "SETTLED_NS", 0)


def _hash_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = cache_mod.fnv1a64
    monkeypatch.setattr(cache_mod, "fnv1a64", lambda d: calls.append(1) or real(d))
    return calls


def test_a_verified_entry_is_read_without_hashing_again(tmp_path: Path, settled: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cache, digest, data = _entry(tmp_path)
    calls = _hash_calls(monkeypatch)
    for _ in range(3):
        region = memoryview(bytearray(SIZE))
        assert cache.load_into(digest, region)
        assert bytes(region) == data
    assert len(calls) == 1  # the first hit only


@pytest.mark.parametrize("change", ["same-size rewrite", "truncate", "extend", "replace"])
def test_a_changed_file_is_verified_again_and_never_served_corrupt(tmp_path: Path, settled: None,
                                                                   change: str) -> None:
    cache, digest, data = _entry(tmp_path)
    assert cache.load_into(digest, memoryview(bytearray(SIZE)))  # verified and trusted
    path = tmp_path / cache_file_name(digest)
    st = os.stat(path)
    bad = bytes([data[0] ^ 0xFF]) + data[1:]
    if change == "same-size rewrite":
        with open(path, "r+b") as f:
            f.write(bad[:1])
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a later mtime, as a real write sets
    elif change == "truncate":
        os.truncate(path, SIZE // 2)
    elif change == "extend":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        other = tmp_path / "elsewhere"
        other.write_bytes(bad)
        os.replace(other, path)
    region = memoryview(bytearray(b"\x11" * SIZE))
    assert not cache.load_into(digest, region)
    assert bytes(region) == b"\x11" * SIZE  # a miss of an unverified file leaves the tensor untouched
    assert not path.exists() or change in ("truncate", "extend")  # corrupt content: deleted
    # A good copy saved again is served again.
    assert cache.save(data) == digest
    region = memoryview(bytearray(SIZE))
    assert cache.load_into(digest, region) and bytes(region) == data


def test_a_file_changed_moments_before_verification_is_not_trusted(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # File times tick coarsely: a change in the same tick as the verified state could keep ctime, so an entry
    # whose last change is less than SETTLED_NS old is verified on every hit until it has settled.
    cache, digest, _data = _entry(tmp_path)
    ctime = os.stat(tmp_path / cache_file_name(digest)).st_ctime_ns
    calls = _hash_calls(monkeypatch)
    monkeypatch.setattr(cache_mod, "_now_ns", lambda: ctime + cache_mod.SETTLED_NS // 2)
    for _ in range(2):
        assert cache.load_into(digest, memoryview(bytearray(SIZE)))
    assert len(calls) == 2
    monkeypatch.setattr(cache_mod, "_now_ns", lambda: ctime + cache_mod.SETTLED_NS)
    for _ in range(2):
        assert cache.load_into(digest, memoryview(bytearray(SIZE)))
    assert len(calls) == 3  # verified once more, trusted from then on
