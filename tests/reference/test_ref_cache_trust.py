"""A hash-cache hit never serves bytes that do not hash to the digest asked for, whatever happened to the file.

Bytes the cache once verified (or saved itself) are read straight into the tensor afterwards, and what landed there
is fingerprinted (XXH3-128) against the verified bytes; the file's identity (device, inode, size, mtime, ctime) only
decides whether a file is read straight into the tensor or verified first.  Each test below names the protection it
exists for; removing that protection makes it fail.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.reference import cache as cache_mod
from ggml_rpc.reference import running_server
from ggml_rpc.reference.cache import HashCache
from ggml_rpc.spec import cache_file_name, fnv1a64
from refhelpers import connect, tensor_in

SIZE = 1 << 16
# Longer than the tick of the coarse clock file times come from (a jiffy: 1-10 ms), so that a change made after it
# gets a later ctime than the one before it on kernels without fine-grained timestamps too.
CLOCK_TICK_S = 0.03
# Well past any "recently changed files are not trusted yet" delay a cache might apply (one of 200 ms was tried).
SETTLE_S = 0.25


def _data(seed: int = 1) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def _entry(tmp_path: Path, seed: int = 1) -> tuple[HashCache, int, bytes]:
    data = _data(seed)
    cache = HashCache(tmp_path)
    assert cache.save(data) == fnv1a64(data)
    return cache, fnv1a64(data), data


def _identity(path: Path) -> tuple[int, int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _rewrite_first_byte(path: Path) -> None:
    """Flip the first byte with write(2), same size, then put atime and mtime back as they were."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _fnv_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = cache_mod.fnv1a64
    monkeypatch.setattr(cache_mod, "fnv1a64", lambda d: calls.append(1) or real(d))
    return calls


class _Recorder:
    """A streaming fingerprint that keeps the pieces it is fed."""

    def __init__(self, inner: object, pieces: list[memoryview]) -> None:
        self.inner, self.pieces = inner, pieces

    def update(self, piece: memoryview) -> None:
        self.pieces.append(piece)
        self.inner.update(piece)  # type: ignore[attr-defined]

    def intdigest(self) -> int:
        return self.inner.intdigest()  # type: ignore[attr-defined]


@pytest.mark.parametrize("origin", ["saved by this server", "found on disk"])
def test_a_hit_fingerprints_the_bytes_that_landed_in_the_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 origin: str) -> None:
    # Protection: the check is made on the tensor's own bytes, after they landed, not on the file.  FNV-1a runs at
    # most once per entry (the first hit of a file this server did not write); every other hit fingerprints, piece
    # by piece, the memory of the region it fills, all of it.
    data = _data()
    digest = fnv1a64(data)
    if origin == "found on disk":
        (tmp_path / cache_file_name(digest)).write_bytes(data)
        cache = HashCache(tmp_path)
    else:
        cache = HashCache(tmp_path)
        assert cache.save(data) == digest
    fnv = _fnv_calls(monkeypatch)
    pieces: list[memoryview] = []
    real = cache_mod._fingerprinter
    monkeypatch.setattr(cache_mod, "_fingerprinter", lambda seed: _Recorder(real(seed), pieces))
    monkeypatch.setattr(cache_mod, "_HASH_CHUNK", SIZE // 4)
    for i in range(3):
        region = memoryview(bytearray(SIZE))
        pieces.clear()
        assert cache.load_into(digest, region)
        assert bytes(region) == data
        if i or origin == "saved by this server":
            whole = np.frombuffer(region, dtype=np.uint8)
            assert len(pieces) == 4 and sum(p.nbytes for p in pieces) == SIZE
            assert all(np.shares_memory(np.frombuffer(p, dtype=np.uint8), whole) for p in pieces)
        else:
            assert not pieces  # the first hit of a foreign file is a verification (FNV-1a of a private copy)
    assert len(fnv) == (1 if origin == "found on disk" else 0)


@pytest.mark.parametrize("change", ["same-size rewrite", "truncate", "extend", "replace"])
def test_a_visibly_changed_file_is_verified_again_and_never_served_corrupt(tmp_path: Path, change: str) -> None:
    cache, digest, data = _entry(tmp_path)
    assert cache.load_into(digest, memoryview(bytearray(SIZE)))  # fingerprinted and read straight into the tensor
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
    assert bytes(region) == b"\x11" * SIZE  # verified before a byte reaches the tensor: a miss leaves it untouched
    assert not path.exists() or change == "extend"  # corrupt or short: deleted (longer: it was being written to)
    # A good copy saved again is served again.
    assert cache.save(data) == digest
    region = memoryview(bytearray(SIZE))
    assert cache.load_into(digest, region) and bytes(region) == data


def test_a_rewrite_that_only_ctime_shows_is_verified_before_the_tensor_is_touched(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Protection: ctime in the identity.  Same inode, same size, mtime put back with utime: only ctime (which no
    # unprivileged process can set) tells the file changed, so it is verified first and the miss leaves the tensor
    # as it was.  Without ctime the file would be read into the tensor; the fingerprint would still refuse it, but
    # the tensor would then hold the corrupt bytes.
    cache, digest, _ = _entry(tmp_path)
    path = tmp_path / cache_file_name(digest)
    assert cache.load_into(digest, memoryview(bytearray(SIZE)))
    before = _identity(path)
    time.sleep(CLOCK_TICK_S)
    _rewrite_first_byte(path)
    after = _identity(path)
    assert after[:4] == before[:4] and after[4] != before[4]  # precondition: only ctime differs
    region = memoryview(bytearray(b"\x11" * SIZE))
    with caplog.at_level(logging.WARNING, logger="ggml_rpc.reference"):
        assert not cache.load_into(digest, region)
    assert bytes(region) == b"\x11" * SIZE
    assert not path.exists()
    assert "is corrupt" in caplog.text


def test_a_write_through_a_shared_mapping_is_never_served(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    # Protection: the fingerprint of the bytes served.  The kernel records a write through a shared mapping in the
    # file's times only at the first write fault on a clean page; later writes to that page change nothing at all
    # (no time, no size, no inode) until writeback.  So: dirty the pages with their own bytes before the entry is
    # verified, then corrupt it through the same mapping; the file's identity is then exactly the one verified.
    # (No os.utime to put the times back: there is nothing to put back, and utime would itself move ctime, which
    # the identity check would catch instead of the fingerprint.)
    with running_server("7", cache_dir=str(tmp_path)) as srv, connect(srv) as c:
        t, _h, _b = tensor_in(c, SIZE)
        # A writeback between the two writes (a sync elsewhere on the machine) re-arms the write fault, and the
        # kernel then records the second write: such an attempt proves nothing, so a fresh entry is tried.
        for seed in (2, 3, 4):
            data = _data(seed)
            digest = fnv1a64(data)
            path = tmp_path / cache_file_name(digest)
            c.set_tensor(t, 0, data, cache_flag=1)
            assert c.device_count() == 1  # the save is done
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED) as m:
                m[:] = m[:]  # a write fault on every page: the times change here, the content does not
                time.sleep(SETTLE_S)  # as for a file that has sat in the cache: its last change lies well behind
                assert c.set_tensor_hash(t, 0, digest) is True  # remembered with the identity the file has now
                verified = _identity(path)
                m[SIZE - 1] = m[SIZE - 1] ^ 0x01  # one bit, in the last page
            if _identity(path) == verified:  # precondition: nothing the kernel keeps shows the write...
                break
        else:
            pytest.fail("every write through the mapping changed the file's identity: the case was never set up")
        assert path.read_bytes() != data  # ...though the content changed
        with caplog.at_level(logging.WARNING, logger="ggml_rpc.reference"):
            assert c.set_tensor_hash(t, 0, digest) is False
        assert "changed although its file's identity did not" in caplog.text
        assert "is corrupt" in caplog.text
        assert not path.exists()
        # The client uploads after a miss: the entry is written anew and served again.
        c.set_tensor(t, 0, data, cache_flag=1)
        assert c.device_count() == 1
        t2, _h2, _b2 = tensor_in(c, SIZE)
        assert c.set_tensor_hash(t2, 0, digest) is True
        assert bytes(c.get_tensor(t2, 0, SIZE)) == data


def test_a_change_within_one_tick_of_a_coarse_file_clock_is_never_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Protection: the fingerprint of the bytes served.  A filesystem with 2-second times and no change time of its
    # own (FAT-like: ctime reads as mtime) shows nothing of a same-size rewrite within the same 2 s; a "settle"
    # delay after the last change, counted from such times, cannot tell either.  Simulated on the identity the
    # cache reads; the rewrite is a real write(2) whose mtime is put back into the same tick.
    tick = 2_000_000_000

    def coarse(st: os.stat_result) -> tuple[int, int, int, int, int]:
        mtime = st.st_mtime_ns // tick * tick
        return (st.st_dev, st.st_ino, st.st_size, mtime, mtime)

    monkeypatch.setattr(cache_mod, "_identity", coarse)
    cache, digest, data = _entry(tmp_path, 4)
    path = tmp_path / cache_file_name(digest)
    region = memoryview(bytearray(SIZE))
    assert cache.load_into(digest, region) and bytes(region) == data
    verified = coarse(os.stat(path))
    _rewrite_first_byte(path)
    assert coarse(os.stat(path)) == verified  # precondition: the coarse clock shows no change
    region = memoryview(bytearray(SIZE))
    with caplog.at_level(logging.WARNING, logger="ggml_rpc.reference"):
        assert not cache.load_into(digest, region)
    assert "changed although its file's identity did not" in caplog.text
    assert not path.exists()
    assert cache.save(data) == digest
    region = memoryview(bytearray(SIZE))
    assert cache.load_into(digest, region) and bytes(region) == data


@pytest.mark.parametrize("when", ["found truncated", "truncated after a hit"])
def test_a_truncated_entry_is_never_served(tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str) -> None:
    # Protection: the verification of a file's bytes and size.  Upstream 6.0.0 wrote entries in place and served a
    # short one (a full disk, a crash) as a hit, leaving the rest of the tensor as it was.
    data = _data(5)
    digest = fnv1a64(data)
    path = tmp_path / cache_file_name(digest)
    if when == "found truncated":
        path.write_bytes(data[: SIZE // 3])
        cache = HashCache(tmp_path)
        asked = cache.entry_size(digest)  # SET_TENSOR_HASH asks at the size the file has
        assert asked == SIZE // 3
    else:
        cache = HashCache(tmp_path)
        assert cache.save(data) == digest
        assert cache.load_into(digest, memoryview(bytearray(SIZE)))
        asked = SIZE  # the size looked up just before the file was cut
        os.truncate(path, SIZE // 3)
    region = memoryview(bytearray(b"\x11" * asked))
    with caplog.at_level(logging.WARNING, logger="ggml_rpc.reference"):
        assert not cache.load_into(digest, region)
    assert bytes(region) == b"\x11" * asked
    assert not path.exists()
    # The log says why: a short file read at its own size is corrupt; one shorter than asked is truncated.
    assert ("is corrupt" if when == "found truncated" else "is truncated (21845 of 65536 bytes)") in caplog.text
    assert cache.save(data) == digest
    region = memoryview(bytearray(SIZE))
    assert cache.load_into(digest, region) and bytes(region) == data
