"""The hash cache: the v6 and v7 save rules, hits, atomic writes on a full disk, corrupt entries, LRU bound."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from ggml_rpc.reference import cache as cache_mod
from ggml_rpc.reference import running_server
from ggml_rpc.reference.cache import HashCache
from ggml_rpc.spec import HASH_THRESHOLD, Command, cache_file_name, fnv1a64, make_tensor
from refhelpers import assert_closes, assert_served, connect, tensor_in

MIB = 1 << 20


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


def test_v6_caches_an_unflagged_12_mib_payload_and_a_hit_fills_the_same_bytes(tmp_path) -> None:
    data = payload(12 * MIB, 1)
    digest = fnv1a64(data)
    with running_server("6", cache_dir=str(tmp_path)) as srv:
        with connect(srv) as c:
            t, _h, _b = tensor_in(c, 12 * MIB)
            assert c.set_tensor_hash(t, 0, digest) is False
            c.set_tensor(t, 0, data)
            assert c.device_count() == 1
        assert entries(tmp_path) == [cache_file_name(digest)]
        assert (tmp_path / cache_file_name(digest)).read_bytes() == data
        with connect(srv) as c:  # a new connection, a new (zeroed) buffer
            t, _h, _b = tensor_in(c, 12 * MIB)
            assert c.set_tensor_hash(t, 0, digest) is True
            assert bytes(c.get_tensor(t, 0, 12 * MIB)) == data


def test_v6_threshold_is_strict(tmp_path) -> None:
    with running_server("6", cache_dir=str(tmp_path)) as srv, connect(srv) as c:
        t, _h, _b = tensor_in(c, HASH_THRESHOLD + 4)
        c.set_tensor(t, 0, payload(HASH_THRESHOLD, 2))
        assert c.device_count() == 1
        assert entries(tmp_path) == []
        bigger = payload(HASH_THRESHOLD + 4, 3)
        c.set_tensor(t, 0, bigger)
        assert c.device_count() == 1
        assert entries(tmp_path) == [cache_file_name(fnv1a64(bigger))]


def test_v7_does_not_cache_an_unflagged_12_mib_payload(tmp_path) -> None:
    data = payload(12 * MIB, 4)
    with running_server("7", cache_dir=str(tmp_path)) as srv, connect(srv) as c:
        t, _h, _b = tensor_in(c, 12 * MIB)
        c.set_tensor(t, 0, data, cache_flag=0)
        assert c.set_tensor_hash(t, 0, fnv1a64(data)) is False
    assert entries(tmp_path) == []


@pytest.mark.parametrize("flag", [1, 2, 0xFF])
def test_v7_caches_a_flagged_4_kib_payload(tmp_path, flag) -> None:
    data = payload(4096, 5)
    digest = fnv1a64(data)
    with running_server("7", cache_dir=str(tmp_path)) as srv:
        with connect(srv) as c:
            t, _h, _b = tensor_in(c, 4096)
            c.set_tensor(t, 0, data, cache_flag=flag)
            assert c.device_count() == 1
        assert entries(tmp_path) == [cache_file_name(digest)]
        with connect(srv) as c:
            t, _h, _b = tensor_in(c, 8192)
            assert c.set_tensor_hash(t, 1000, digest) is True
            got = bytes(c.get_tensor(t, 0, 8192))
            assert got == bytes(1000) + data + bytes(8192 - 1000 - 4096)


def test_enospc_during_a_cache_write_leaves_no_partial_file(tmp_path, monkeypatch) -> None:
    calls = {"n": 0}
    real_write = os.write

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, memoryview(data)[:1000])  # part of it lands, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache_mod, "_write", full_disk)
    data = payload(4096, 6)
    with running_server("7", cache_dir=str(tmp_path)) as srv, connect(srv) as c:
        t, _h, _b = tensor_in(c, 4096)
        c.set_tensor(t, 0, data, cache_flag=1)
        # The write itself still happened; only the cache entry is missing, and nothing half-written is left.
        assert bytes(c.get_tensor(t, 0, 4096)) == data
        assert calls["n"] == 2
        assert entries(tmp_path) == []
        assert c.set_tensor_hash(t, 0, fnv1a64(data)) is False


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_corrupted_entry_is_never_served(tmp_path, damage) -> None:
    data = payload(4096, 7)
    digest = fnv1a64(data)
    path = tmp_path / cache_file_name(digest)
    bad = {"flip": data[:100] + bytes([data[100] ^ 1]) + data[101:], "truncate": data[:4000],
           "extend": data + b"\0"}[damage]
    path.write_bytes(bad)
    with running_server("7", cache_dir=str(tmp_path)) as srv, connect(srv) as c:
        t, _h, _b = tensor_in(c, 8192)
        c.set_tensor(t, 0, b"\x11" * 8192)
        assert c.set_tensor_hash(t, 0, digest) is False
        assert bytes(c.get_tensor(t, 0, 8192)) == b"\x11" * 8192  # untouched
    assert not path.exists()  # deleted, so the next save can write a good one


def test_hash_hit_with_a_bad_tensor_closes(tmp_path) -> None:
    data = payload(4096, 8)
    digest = fnv1a64(data)
    (tmp_path / cache_file_name(digest)).write_bytes(data)
    # (tensor, offset): null buffer / region past the buffer end / inside the buffer but past the tensor's nbytes
    cases = [
        (lambda h, base: make_tensor(id=1, ne=(2048,)), 0),
        (lambda h, base: make_tensor(id=1, ne=(2048,), buffer=h, data=base), 6144),
        (lambda h, base: make_tensor(id=1, ne=(16,), buffer=h, data=base), 0),
    ]
    with running_server("7", cache_dir=str(tmp_path)) as srv:
        for build, offset in cases:
            with connect(srv) as c:
                _t, h, base = tensor_in(c, 8192)
                assert_closes(c, Command.SET_TENSOR_HASH, {"tensor": build(h, base), "offset": offset, "hash": digest})
            assert_served(srv)
        with connect(srv) as c:  # and the entry still serves a good request
            t, _h, _b = tensor_in(c, 4096)
            assert c.set_tensor_hash(t, 0, digest) is True


def test_lru_bound_evicts_least_recently_used(tmp_path) -> None:
    a, b, c_, d = (payload(4096, s) for s in (10, 11, 12, 13))
    with running_server("7", cache_dir=str(tmp_path), cache_max_bytes=3 * 4096) as srv, connect(srv) as c:
        t, _h, _b = tensor_in(c, 4096)
        for data in (a, b, c_):
            c.set_tensor(t, 0, data, cache_flag=1)
        assert c.set_tensor_hash(t, 0, fnv1a64(a)) is True  # a becomes the most recently used
        c.set_tensor(t, 0, d, cache_flag=1)
        assert c.device_count() == 1
        names = set(entries(tmp_path))
        assert names == {cache_file_name(fnv1a64(x)) for x in (a, c_, d)}  # b was the least recently used
        assert sum((tmp_path / n).stat().st_size for n in names) <= 3 * 4096


def test_payload_larger_than_the_cache_bound_is_not_saved(tmp_path) -> None:
    cache = HashCache(tmp_path, max_bytes=1000)
    assert cache.save(payload(2000)) is None
    assert entries(tmp_path) == []


def test_stale_temporary_files_are_removed_at_start(tmp_path) -> None:
    (tmp_path / ".tmp-0123456789abcdef-dead").write_bytes(b"half")
    keep = payload(64, 9)
    (tmp_path / cache_file_name(fnv1a64(keep))).write_bytes(keep)
    cache = HashCache(tmp_path)
    assert entries(tmp_path) == [cache_file_name(fnv1a64(keep))]
    assert cache.total_bytes == 64


def test_files_not_named_as_entries_are_left_alone_and_not_counted(tmp_path) -> None:
    keep = payload(64, 9)
    name = cache_file_name(fnv1a64(keep))
    (tmp_path / name).write_bytes(keep)
    # Upper case, a prefix, one digit short or long, an extension: none is a name the spec gives an entry.
    foreign = [name.upper(), "0x" + name[2:], name[1:], name + "0", name + ".bin"]
    for other in foreign:
        (tmp_path / other).write_bytes(b"not an entry")
    cache = HashCache(tmp_path)
    assert cache.total_bytes == 64
    assert entries(tmp_path) == sorted([name, *foreign])


def test_cache_is_shared_between_connections_of_a_concurrent_server(tmp_path) -> None:
    data = payload(4096, 14)
    with running_server("7", cache_dir=str(tmp_path), concurrent=True) as srv:
        with connect(srv) as one, connect(srv) as two:
            t1, _h, _b = tensor_in(one, 4096)
            t2, _h2, _b2 = tensor_in(two, 4096)
            one.set_tensor(t1, 0, data, cache_flag=1)
            assert one.device_count() == 1
            assert two.set_tensor_hash(t2, 0, fnv1a64(data)) is True
            assert bytes(two.get_tensor(t2, 0, 4096)) == data
            assert two.expect_closed(0.05) is False


def test_hash_miss_with_a_cache_does_not_validate_the_tensor(tmp_path) -> None:
    with running_server("6", cache_dir=str(tmp_path)) as srv, connect(srv) as c:
        garbage = make_tensor(id=1) | {"type": 250, "buffer": 0x77, "data": 2**64 - 1}
        assert c.set_tensor_hash(garbage, 2**64 - 1, 0xFEED) is False
        assert c.device_count() == 1


def test_a_miss_waits_for_a_save_under_way_on_another_connection(tmp_path) -> None:
    import threading
    import time

    from ggml_rpc.spec import request_parts

    data = payload(64 * 1024, 15)
    digest = fnv1a64(data)
    with running_server("7", cache_dir=str(tmp_path), concurrent=True) as srv:
        with connect(srv) as uploader, connect(srv) as asker:
            t1, _h, _b = tensor_in(uploader, len(data))
            t2, _h2, _b2 = tensor_in(asker, len(data))
            parts = request_parts(uploader.protocol, Command.SET_TENSOR, {"tensor": t1, "offset": 0, "cache_flag": 1},
                                  data)
            uploader.send_raw([*parts[:-1], data[:1000]])  # the upload is under way...
            time.sleep(0.5)
            answer = {}
            asking = threading.Thread(target=lambda: answer.setdefault("hit", asker.set_tensor_hash(t2, 0, digest)))
            asking.start()
            time.sleep(0.2)
            assert asking.is_alive()  # ...so the miss waits for it
            uploader.send_raw(data[1000:])
            asking.join(10)
            assert answer == {"hit": True}
            assert bytes(asker.get_tensor(t2, 0, len(data))) == data


def test_an_existing_entry_is_not_rewritten_but_a_damaged_one_is_replaced(tmp_path, monkeypatch) -> None:
    writes = []
    real_write = os.write
    monkeypatch.setattr(cache_mod, "_write", lambda fd, data: writes.append(len(data)) or real_write(fd, data))
    cache = HashCache(tmp_path)
    data = payload(4096, 16)
    digest = fnv1a64(data)
    assert cache.save(data) == digest and writes == [4096]
    assert cache.save(data) == digest and writes == [4096]  # v6 re-uploads: no second write
    (tmp_path / cache_file_name(digest)).write_bytes(b"x" * 4096)  # damaged behind the cache's back
    assert cache.load(digest, 4096) is None and not (tmp_path / cache_file_name(digest)).exists()
    assert cache.save(data) == digest and writes == [4096, 4096]
    assert bytes(cache.load(digest, 4096)) == data
