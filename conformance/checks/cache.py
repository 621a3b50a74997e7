"""Hash-cache semantics, observed from outside through SET_TENSOR_HASH hits and misses.

Whether a server has a cache at all is learnt once per run: a payload the version's rule says must be saved (v7: a
small SET_TENSOR with cache_flag = 1; v6: a SET_TENSOR just over 10 MiB) is written, then asked for by hash.  No
hit means no cache: the cache checks then skip, unless the run was told the cache directory (``--cache-dir``, or
the embedded server), in which case a missing entry is a failure.  Every payload is fresh random bytes, so entries
left by earlier runs never answer for this one.  With a known directory, white-box checks also read the files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ggml_rpc.conformance.checks._support import (
    Buf,
    alloc,
    expect_bytes,
    fail,
    nonce,
    read_back,
    send_and_expect_close,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.harness import Category, CheckFailed, Context, Skipped, hexdump
from ggml_rpc.spec import HASH_THRESHOLD, cache_file_name, encode_request, fnv1a64
from ggml_rpc.spec import Command as C

_ENTRY_NAME = re.compile(r"[0-9a-f]{16}")
V6C = Category.CACHE_V6
V7C = Category.CACHE_V7
SMALL = 4096


@dataclass(frozen=True, slots=True)
class Entry:
    """A payload the server saved during this run."""

    digest: int
    data: bytes


def _put(client: RpcClient, data: bytes, flag: int = 0) -> Buf:
    """A buffer holding ``data`` (written by one SET_TENSOR, with ``flag`` on v7).  A flagged write follows a
    SET_TENSOR_HASH of the same data and region that missed, as a client's does (the spec's CACHE-FLAG-NO-MISS):
    the checks that save an entry send nothing a server may refuse."""
    buf = alloc(client, len(data) + 64)
    tensor = buf.tensor(0, len(data))
    if client.protocol is not None and client.protocol.cache_rule.flag_field:
        if flag:
            client.set_tensor_hash(tensor, 0, fnv1a64(data))  # a nonce's hash: never cached, a miss
        client.set_tensor(tensor, 0, data, cache_flag=flag)
    else:
        client.set_tensor(tensor, 0, data)
    return buf


def _hit(client: RpcClient, digest: int, n: int) -> bool:
    """Ask for ``digest`` into a fresh buffer of ``n`` bytes."""
    buf = alloc(client, n + 64)
    return client.set_tensor_hash(buf.tensor(0, n), 0, digest)


def _saving_payload(ctx: Context) -> tuple[bytes, int]:
    """A payload this version's rule saves, and the flag to send with it."""
    if ctx.protocol.cache_rule.flag_field:
        return nonce(SMALL), 1
    return nonce(HASH_THRESHOLD + 4), 0


def _probe(ctx: Context) -> Entry | None:
    client = ctx.connect()
    data, flag = _saving_payload(ctx)
    _put(client, data, flag)
    digest = fnv1a64(data)
    hit = _hit(client, digest, len(data))
    client.close()
    return Entry(digest, data) if hit else None


def saved_entry(ctx: Context) -> Entry:
    """The run's saved entry; skips (no cache observable) or fails (cache directory known) when there is none."""
    entry = ctx.shared("cache-entry", lambda: _probe(ctx))
    if entry is not None:
        ctx.info.cache = True
        return entry
    ctx.info.cache = False
    rule = ctx.protocol.cache_rule
    what = "a SET_TENSOR with cache_flag 1" if rule.flag_field else f"a SET_TENSOR of {HASH_THRESHOLD + 4} bytes"
    if ctx.cache_dir is not None:
        raise CheckFailed(f"the server has a cache directory ({ctx.cache_dir}) but {what} was not saved: "
                          "SET_TENSOR_HASH of its FNV-1a missed", expected="SET_TENSOR_HASH result 1",
                          got="result 0")
    raise Skipped(f"no hash cache observed ({what} is not answered by SET_TENSOR_HASH); start the server with a "
                  "cache (ggml-rpc serve --cache-dir DIR; upstream rpc-server -c) to run the cache checks, and pass "
                  "the check --cache-dir DIR to make a missing cache a failure")


def _expect_hit(ctx: Context, client: RpcClient, data: bytes, why: str) -> None:
    digest = fnv1a64(data)
    if not _hit(client, digest, len(data)):
        raise fail(f"{why}: SET_TENSOR_HASH missed", sent=f"hash {cache_file_name(digest)} ({len(data)} bytes)",
                   expected="result 1 (saved)", got="result 0")
    ctx.note(why, sent=f"hash {cache_file_name(digest)}", got="hit")


def _expect_miss(ctx: Context, client: RpcClient, data: bytes, why: str) -> None:
    digest = fnv1a64(data)
    if _hit(client, digest, len(data)):
        raise fail(f"{why}: SET_TENSOR_HASH hit", sent=f"hash {cache_file_name(digest)} ({len(data)} bytes)",
                   expected="result 0 (not saved)", got="result 1")
    ctx.note(why, sent=f"hash {cache_file_name(digest)}", got="miss")


def _fills(ctx: Context, entry: Entry) -> None:
    """A hit writes exactly the cached bytes at the requested offset, nothing around them."""
    client = ctx.connect()
    n = len(entry.data)
    buf = alloc(client, n + 64)
    t = buf.tensor(0, n + 32)
    before = nonce(32)
    client.set_tensor(buf.tensor(0, 32, id=2), 0, before)
    if not client.set_tensor_hash(t, 16, entry.digest):
        raise fail("SET_TENSOR_HASH of an entry saved earlier in this run missed", expected="result 1",
                   got="result 0")
    got = read_back(buf, 0, n + 16)
    expect_bytes("tensor filled from the cache at offset 16", got, before[:16] + entry.data)


def _white_box(ctx: Context, entry: Entry) -> str:
    if ctx.cache_dir is None:
        raise Skipped("cache directory unknown (pass --cache-dir DIR to read the cache files)")
    name = cache_file_name(entry.digest)
    candidates = [Path(ctx.cache_dir) / name, Path(ctx.cache_dir) / "rpc" / name]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise fail("no cache file named after the payload's FNV-1a-64", expected=" or ".join(map(str, candidates)),
                   got="missing")
    content = found.read_bytes()
    if content != entry.data:
        raise fail("cache file content is not the raw payload", expected=f"{len(entry.data)} bytes: "
                   + hexdump(entry.data, 16), got=f"{len(content)} bytes: " + hexdump(content, 16))
    stray = sorted(p.name for p in found.parent.iterdir() if p.is_file() and not _ENTRY_NAME.fullmatch(p.name))
    if stray:
        raise fail("stray files in the cache directory (temporary or partial writes?)",
                   expected="only files named by 16 lowercase hex digits", got=", ".join(stray[:5]))
    return str(found)


# ---- v7: the flag decides -------------------------------------------------------------------------------------


@_check("CACHE-V7-001", "a SET_TENSOR with cache_flag 1 is saved: SET_TENSOR_HASH of its FNV-1a hits", V7C,
        majors=(7, 8), section=C.SET_TENSOR)
def v7_flag_saves(ctx: Context) -> None:
    saved_entry(ctx)


@_check("CACHE-V7-002", "a SET_TENSOR with cache_flag 0 is never saved, whatever its size (> 10 MiB too)", V7C,
        majors=(7, 8), section="v7-cache-rule")
def v7_unflagged(ctx: Context) -> None:
    saved_entry(ctx)
    client = ctx.connect()
    for n in (SMALL, HASH_THRESHOLD + 4):
        data = nonce(n)
        _put(client, data, 0)
        _expect_miss(ctx, client, data, f"unflagged SET_TENSOR of {n} bytes")


@_check("CACHE-V7-003", "any non-zero cache_flag (2, 0xff) asks for a save", V7C, majors=(7, 8), section=C.SET_TENSOR)
def v7_any_flag(ctx: Context) -> None:
    saved_entry(ctx)
    client = ctx.connect()
    for flag in (2, 0xFF):
        data = nonce(SMALL)
        _put(client, data, flag)
        _expect_hit(ctx, client, data, f"SET_TENSOR with cache_flag {flag:#x}")


@_check("CACHE-V7-004", "a hit writes exactly the cached bytes at the requested offset", V7C, majors=(7, 8),
        section=C.SET_TENSOR_HASH)
def v7_hit_fills(ctx: Context) -> None:
    _fills(ctx, saved_entry(ctx))


@_check("CACHE-V7-005", "a flagged SET_TENSOR still writes the tensor", V7C, majors=(7, 8), section=C.SET_TENSOR)
def v7_flag_writes(ctx: Context) -> None:
    saved_entry(ctx)
    client = ctx.connect()
    data = nonce(SMALL)
    buf = _put(client, data, 1)
    expect_bytes("tensor after a flagged SET_TENSOR", read_back(buf, 0, len(data)), data)


@_check("CACHE-V7-006", "miss, flagged SET_TENSOR, then a hit on a new connection fills identical bytes", V7C,
        majors=(7, 8), section=C.SET_TENSOR_HASH)
def v7_across_connections(ctx: Context) -> None:
    saved_entry(ctx)
    first = ctx.connect()
    data = nonce(SMALL)
    digest = fnv1a64(data)
    buf = alloc(first, len(data) + 64)
    if first.set_tensor_hash(buf.tensor(0, len(data)), 0, digest):
        raise fail("SET_TENSOR_HASH of fresh random data hit before anything was saved", expected="result 0",
                   got="result 1")
    first.set_tensor(buf.tensor(0, len(data)), 0, data, cache_flag=1)  # what a v7 client sends after a miss
    first.close()
    second = ctx.connect()
    target = alloc(second, len(data) + 64)
    if not second.set_tensor_hash(target.tensor(0, len(data)), 0, digest):
        raise fail("entry saved by the previous connection: SET_TENSOR_HASH missed",
                   sent=f"hash {cache_file_name(digest)}", expected="result 1", got="result 0")
    expect_bytes("tensor filled by the hit on a new connection", read_back(target, 0, len(data)), data)


@_check("CACHE-V7-007", "white-box: the entry is a file named by the 16-hex-digit FNV-1a holding the raw payload",
        V7C, majors=(7, 8), section="v7-cache-rule")
def v7_file(ctx: Context) -> str:
    return _white_box(ctx, saved_entry(ctx))


# ---- v6: the size decides --------------------------------------------------------------------------------------


@_check("CACHE-V6-001", "a SET_TENSOR larger than 10 MiB is saved: SET_TENSOR_HASH of its FNV-1a hits", V6C,
        majors=(6,), section="v6-cache-rule")
def v6_large_saved(ctx: Context) -> None:
    saved_entry(ctx)


@_check("CACHE-V6-002", "a SET_TENSOR of exactly 10 MiB is not saved (the threshold is strict)", V6C, majors=(6,),
        section="v6-cache-rule")
def v6_threshold(ctx: Context) -> None:
    saved_entry(ctx)
    client = ctx.connect()
    data = nonce(HASH_THRESHOLD)
    _put(client, data)
    _expect_miss(ctx, client, data, "SET_TENSOR of exactly 10 MiB")


@_check("CACHE-V6-003", "a small SET_TENSOR is not saved", V6C, majors=(6,), section="v6-cache-rule")
def v6_small(ctx: Context) -> None:
    saved_entry(ctx)
    client = ctx.connect()
    data = nonce(SMALL)
    _put(client, data)
    _expect_miss(ctx, client, data, f"SET_TENSOR of {SMALL} bytes")


@_check("CACHE-V6-004", "a hit writes exactly the cached bytes at the requested offset", V6C, majors=(6,),
        section=C.SET_TENSOR_HASH)
def v6_hit_fills(ctx: Context) -> None:
    _fills(ctx, saved_entry(ctx))


@_check("CACHE-V6-005", "white-box: the entry is a file named by the 16-hex-digit FNV-1a holding the raw payload",
        V6C, majors=(6,), section="v6-cache-rule")
def v6_file(ctx: Context) -> str:
    return _white_box(ctx, saved_entry(ctx))


# ---- both: a hit still obeys the tensor rules ------------------------------------------------------------------


@_check("FRAME-034", "SET_TENSOR_HASH hit for a tensor without a known buffer closes the connection",
        Category.FRAMING, section=C.SET_TENSOR_HASH)
def hash_hit_no_buffer(ctx: Context) -> None:
    entry = saved_entry(ctx)
    client = ctx.connect()
    buf = alloc(client, len(entry.data) + 64)
    t = buf.tensor(0, len(entry.data), buffer=0)
    sent = encode_request(ctx.protocol, C.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": entry.digest})
    send_and_expect_close(ctx, client, sent, "SET_TENSOR_HASH hit into a tensor with buffer 0")


@_check("FRAME-035", "SET_TENSOR_HASH hit for a region that does not fit the buffer closes the connection",
        Category.FRAMING, section=C.SET_TENSOR_HASH)
def hash_hit_no_room(ctx: Context) -> None:
    entry = saved_entry(ctx)
    client = ctx.connect()
    buf = alloc(client, len(entry.data) + 64)
    t = buf.tensor(buf.size - 16, 16)
    sent = encode_request(ctx.protocol, C.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": entry.digest})
    send_and_expect_close(ctx, client, sent, f"SET_TENSOR_HASH hit of {len(entry.data)} bytes into the last 16 "
                          "bytes of the buffer")
