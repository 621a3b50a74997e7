"""The hunt's strategy that writes through every geometry into canaries (``shadow_write``).

Three fresh buffers -- a sentinel, the working buffer, a sentinel -- are filled with canaries (known pseudo-random
bytes, made known to the example's shadow-memory oracle, :mod:`.shadow`), then one write-capable command of the
version writes a tensor drawn by the one geometry generator (:mod:`ggml_rpc.spec.geometry`) against the working
buffer; the oracle reads back, after the write, what it must not have touched.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from ggml_rpc.conformance.harness.shadow import GRAPH_TYPES, WriteRequest, canary_bytes, write_request
from ggml_rpc.spec import Command, GgmlOp, GgmlType, TensorFlag, make_tensor, null_tensor
from ggml_rpc.spec.geometry import ORDINARY_SHAPES, PLACES, VIEWS, Geometry, Span, draw_geometry, place_class
from ggml_rpc.spec.tensor import src_ids

from .draws import RandomDraw
from .message import FuzzMessage
from .shadow import CANARY_TAG
from .valid_requests import BufferRef, ConnRef

if TYPE_CHECKING:
    from .example import Example


# ---- the hunt's strategy ------------------------------------------------------------------------------------------

#: Sizes of a working buffer (the last ones are sampled, not read whole), and of its sentinels.
WORK_SIZES = (64, 256, 1024, 4096, 16384, 65536)
SENTINEL_SIZES = (64, 256, 4096)
#: Places drawn for the written tensor: mostly inside the buffer (the oracle judges what a server accepts), edges
#: above all; the others are near-valid (a server must refuse them).
_PLACE_WEIGHTS = {"inside": 3, "misaligned": 2, "at-start": 4, "at-end": 8, "below": 1, "across-end": 2,
                  "past-end": 2, "other-buffer": 2, "freed-buffer": 1, "null-buffer": 1, "unknown-buffer": 1}
_PLACES = tuple(p for p in PLACES for _ in range(_PLACE_WEIGHTS.get(p, 1)))


def _guarded(ex: Example, rng: random.Random) -> tuple[ConnRef, BufferRef, BufferRef, BufferRef] | None:
    """Sentinel, working buffer, sentinel on the active connection, canaries in all three (None: refused)."""
    conn = ex.active()
    bufs = []
    sizes = (rng.choice(SENTINEL_SIZES), rng.choice(WORK_SIZES), rng.choice(SENTINEL_SIZES))
    for size, role in zip(sizes, ("sentinel before the working buffer", "the working buffer",
                                  "sentinel after the working buffer"), strict=True):
        buf = ex.alloc(conn, size, 0)
        if buf is None or ex.inert:
            return None
        fill_canary(ex, conn, buf, rng.getrandbits(64), role)
        bufs.append(buf)
    if ex.inert or ex.current is not conn:
        return None
    return conn, bufs[0], bufs[1], bufs[2]


def shadow_write(h: object, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """Sentinel, working buffer, sentinel (canaries in all three), then one write through a drawn geometry."""
    sh = ex.shadow
    if sh is None:
        return
    guarded = _guarded(ex, rng)
    if guarded is None:
        return
    conn, before, work, after = guarded
    commands = [c for c in (Command.SET_TENSOR, Command.SET_TENSOR_2D, Command.SET_TENSOR_HASH, Command.COPY_TENSOR,
                            Command.MEMSET_TENSOR, Command.BUFFER_CLEAR, Command.INIT_TENSOR, Command.GRAPH_COMPUTE)
                if c in ex.protocol.commands]
    command = rng.choice(commands)
    msg, geometry = write_message(ex, d, rng, command, work, (before, after))
    if msg is None:
        return
    if geometry is not None:
        sh.note(msg, geometry)
    ex.send(conn, msg)


#: Places of a tensor of zero elements that a bounds check of [data, data + nbytes) alone lets through only because
#: nbytes is 0 (protocol 8.0.0's deserialize_tensor is said to skip the check for such tensors).
ZERO_PLACES = ("below", "past-end", "across-end", "other-buffer", "freed-buffer")
#: Shapes with zero elements (one per dimension).
EMPTY_SHAPES = tuple(f"empty-{k}" for k in range(4))


def empty_outside(h: object, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A tensor of zero elements outside its buffer (below, past or across its end, inside another or a freed
    buffer), between canary-filled sentinels, in one of the version's commands that take a tensor -- as a write's
    destination, a copy's source, a read's tensor, a graph's node or source -- so that whatever a server does with
    an address it never checked shows: a close, a crash, a reply where the reference closes, or changed bytes."""
    guarded = _guarded(ex, rng)
    if guarded is None:
        return
    conn, before, work, after = guarded
    if rng.random() < 0.3:  # a freed buffer of the connection for the "freed-buffer" place
        gone = ex.alloc(conn, rng.choice(SENTINEL_SIZES), 0)
        if gone is None or ex.inert:
            return
        ex.send(conn, FuzzMessage(Command.FREE_BUFFER, {"remote_ptr": gone.handle}))
    if ex.inert or ex.current is not conn:
        return
    others, freed = _spans(ex, conn, work)
    g = draw_geometry(d, Span(work.handle, work.base, work.size), id=ex.scope.new_id(), shape=rng.choice(EMPTY_SHAPES),
                      where=rng.choice(ZERO_PLACES), others=others, freed=freed, alignment=ex.host.alignment)
    t = g.fields
    commands = [c for c in (Command.SET_TENSOR, Command.SET_TENSOR_2D, Command.SET_TENSOR_HASH, Command.GET_TENSOR,
                            Command.GET_TENSOR_2D, Command.COPY_TENSOR, Command.MEMSET_TENSOR, Command.INIT_TENSOR,
                            Command.GET_ALLOC_SIZE, Command.GRAPH_COMPUTE) if c in ex.protocol.commands]
    command = rng.choice(commands)
    src = make_tensor(id=ex.scope.new_id(), type=int(GgmlType.I8), ne=(min(64, before.size),), buffer=before.handle,
                      data=before.base)
    path = "tensor"
    flag = ex.protocol.cache_rule.flag_field
    fields: dict[str, Any]
    data: bytes | None = None
    if command is Command.SET_TENSOR:
        fields = {"tensor": t, "offset": 0, **({flag: 0} if flag else {})}
        data = rng.randbytes(rng.choice((0, 1, 16)))
    elif command in (Command.SET_TENSOR_2D, Command.GET_TENSOR_2D):
        rows, size = rng.choice((1, 2)), rng.choice((1, 16))
        fields = {"tensor": t, "offset": 0, "size": size, "n_copies": rows, "stride": size}
        data = rng.randbytes(size * rows) if command is Command.SET_TENSOR_2D else None
    elif command is Command.SET_TENSOR_HASH:
        fields = {"tensor": t, "offset": 0, "hash": rng.choice(ex.scope.hashes) if ex.scope.hashes else 0}
    elif command in (Command.GET_TENSOR, Command.MEMSET_TENSOR):
        fields = {"tensor": t, "offset": 0, "size": rng.choice((0, 1, 16))}
        if command is Command.MEMSET_TENSOR:
            fields["value"] = rng.randrange(256)
    elif command is Command.COPY_TENSOR:
        as_dst = rng.random() < 0.6
        fields = {"src": src, "dst": t} if as_dst else {"src": t, "dst": src}
        path = "dst" if as_dst else "src"
    elif command is Command.INIT_TENSOR:
        fields = {"tensor": t}
    elif command is Command.GET_ALLOC_SIZE:
        fields = {"device": 0, "tensor": t, "srcs": [null_tensor() for _ in range(10)]}
    else:
        # A node of zero elements computed from a source, or a node whose source has zero elements.
        out = make_tensor(id=ex.scope.new_id(), type=t["type"], ne=tuple(t["ne"]), nb=tuple(t["nb"]),
                          buffer=after.handle, data=after.base)
        as_node = rng.random() < 0.5
        node = dict(t if as_node else out, op=int(GgmlOp.DUP), flags=int(TensorFlag.COMPUTE),
                    src=src_ids(out["id"] if as_node else t["id"]))
        tensors = [out, node] if as_node else [t, node]
        fields = {"device": 0, "nodes": [node["id"]], "tensors": tensors}
        path = f"tensors.{1 if as_node else 0}"
    msg = FuzzMessage(command, fields, data, broken=f"bound: {path}.data = {t['data']:#x} (zero elements, {g.place})",
                      tags=("zero-elements",))
    if ex.shadow is not None:
        ex.shadow.note(msg, g)
    ex.send(conn, msg)


def fill_canary(ex: Example, conn: ConnRef, buf: BufferRef, seed: int, role: str = "") -> None:
    """SET_TENSOR of canary bytes over a whole buffer (model and target), made known to the oracle."""
    if not buf.size:
        return
    whole = make_tensor(id=ex.scope.new_id(), type=int(GgmlType.I8), ne=(buf.size,), buffer=buf.handle,
                        data=buf.base)
    fields: dict[str, Any] = {"tensor": whole, "offset": 0}
    if ex.protocol.cache_rule.flag_field:
        fields[ex.protocol.cache_rule.flag_field] = 0
    ex.send(conn, FuzzMessage(Command.SET_TENSOR, fields, canary_bytes(buf.size, seed), tags=(CANARY_TAG,)))
    mem = ex.shadow.memory(conn) if ex.shadow is not None else None
    if mem is not None:
        mem.mark(buf.handle, role=role)


def _spans(ex: Example, conn: ConnRef, work: BufferRef) -> tuple[list[Span], list[Span]]:
    """Other live buffers (placed where they lie on the *target* relative to ``work``, so that relocation lands a
    tensor inside the real other buffer) and freed ones of the connection."""
    model = ex.models[conn]
    bases = ex.reloc.bases
    others, freed = [], []
    here = bases.get(work.handle)
    for b in ex.scope.all_buffers:
        if b.conn is not conn or b.incarnation != conn.incarnation or b is work or not b.size:
            continue
        if b.handle not in model.buffers:
            freed.append(Span(b.handle, b.base, b.size))
        elif here is not None and b.handle in bases:
            others.append(Span(b.handle, work.base + (bases[b.handle][1] - here[1]), b.size))
    return others, freed


def write_message(ex: Example, d: RandomDraw, rng: random.Random, command: Command, work: BufferRef,
                  sentinels: tuple[BufferRef, BufferRef]) -> tuple[FuzzMessage | None, Geometry | None]:
    """One ``command`` whose destination is drawn by the geometry generator against ``work``."""
    conn = ex.current
    assert conn is not None
    others, freed = _spans(ex, conn, work)
    span = Span(work.handle, work.base, work.size)
    graph = command is Command.GRAPH_COMPUTE
    g = draw_geometry(d, span, id=ex.scope.new_id(), where=rng.choice(_PLACES), shapes=ORDINARY_SHAPES,
                      others=others, freed=freed, alignment=ex.host.alignment,
                      **({"types": GRAPH_TYPES} if graph else {}), max_span=min(work.size, 4096) or 64)
    view = rng.choice(VIEWS) if graph and g.nbytes and rng.random() < 0.3 else None
    n = g.nbytes
    home = next((s for s in sentinels if s.size >= max(n, 1)), work)
    ids = iter(ex.scope.new_id() for _ in range(4))
    req = write_request(ex.protocol, command, g, d, rng, source=Span(home.handle, home.base, home.size), ids=ids,
                        span=span, view=view)
    if req is None:
        return None, None
    if req.cached is not None:
        _cache_entry(ex, conn, sentinels[0], req.cached)
    broken = _broken(req, g)
    return FuzzMessage(command, req.fields, req.data, broken=broken), req.geometry


def _broken(req: WriteRequest, g: Geometry) -> str | None:
    """The rule a drawn write breaks, named as the other generators name the field (so that the classes meet):
    a tensor outside its buffer (``bound: <tensor>.data``), a node viewing past its source (``view: ...``)."""
    if req.geometry is None:
        return None
    path = {Command.COPY_TENSOR: "dst" if req.fields.get("dst") is g.fields else "src"}.get(req.command, "tensor")
    if req.command is Command.GRAPH_COMPUTE:
        tensors = req.fields["tensors"]
        path = f"tensors.{next(i for i, t in enumerate(tensors) if t['id'] == g.fields['id'])}"
    if not g.in_buffer:
        # Named by where it lies (a tensor drawn at the end of a buffer it does not fit begins below it).
        where = place_class(g.fields, g.nbytes, g.span if g.fields["buffer"] == g.span.handle else None) \
            if g.span is not None else g.place
        return f"bound: {path}.data = {g.fields['data']:#x} ({where})"
    v = req.geometry
    if v.view is not None and v.fields["view_offs"] + v.nbytes > g.nbytes:
        node = len(req.fields["tensors"]) - 1
        return f"view: tensors.{node}.view_offs = {v.fields['view_offs']:#x} ({v.view})"
    return None


def _cache_entry(ex: Example, conn: ConnRef, buf: BufferRef, data: bytes) -> None:
    """Make the server's cache hold ``data`` (a flagged SET_TENSOR) where the model has a cache too; else the hash
    misses on both sides, and the oracle checks that a miss writes nothing."""
    rule = ex.protocol.cache_rule
    if ex.host.model_cache is None or rule.flag_field is None or len(data) > buf.size:
        return
    t = make_tensor(id=ex.scope.new_id(), type=int(GgmlType.I8), ne=(len(data),), buffer=buf.handle, data=buf.base)
    ex.send(conn, FuzzMessage(Command.SET_TENSOR, {"tensor": t, "offset": 0, rule.flag_field: 1}, data))


__all__ = ["EMPTY_SHAPES", "ZERO_PLACES", "empty_outside", "fill_canary", "shadow_write", "write_message"]
