"""Data: the shadow-memory checks (SHADOW-0xx): a write touches its destination and nothing else.

Each check is one write-capable command and one class of geometries of the tensor it writes (drawn by the one
generator, :mod:`ggml_rpc.spec.geometry`): ``edges`` (the tensor at its buffer's first or last byte), ``shapes``
(non-contiguous, broadcast, overlapping, negative and empty shapes inside the buffer), ``views`` (a graph node that
views another tensor), ``outside`` (a tensor of zero elements below, across or past its buffer, or inside another
buffer: ggml_nbytes is 0 whatever its address, which 8.0.0's deserialize_tensor is said to leave unchecked).

Every case runs in a :class:`~.shadow_session.ShadowSession`: a sentinel, the working buffer and a sentinel, all
filled with canaries, mirrored by the reference core in this process. After the write, every buffer is read back
whole; a byte the shadow knows that differs fails the check, naming the buffer, the offsets and the bytes. A request
the reference refuses must be refused (closed) or, when the server goes on, have written nothing outside what it
named; its other refusals are the FRAME checks' business.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.checks.shadow_session import ShadowSession
from ggml_rpc.conformance.harness import Category, Context, Level
from ggml_rpc.conformance.harness.shadow import GRAPH_TYPES, destination, write_request
from ggml_rpc.spec import Command as C
from ggml_rpc.spec import GgmlType, fnv1a64, make_tensor
from ggml_rpc.spec.geometry import DEFAULT_TYPES, VIEWS, Geometry, draw_geometry

DA = Category.DATA

#: (places, shapes) of each geometry class.
CLASSES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "edges": (("at-start", "at-end"), ("contiguous", "one-element", "block-edge")),
    "shapes": (("inside", "misaligned", "at-end"), ("padded", "transposed", "broadcast", "overlapping",
                                                    "negative-unit", "empty-0", "empty-1", "empty-2", "empty-3")),
    "views": (("inside", "at-end"), ("contiguous", "padded")),
    "outside": (("below", "across-end", "past-end", "other-buffer"), ("empty-0", "empty-1", "empty-2", "empty-3")),
}
#: What each class says, for the checks' titles.
CLASS_TEXT = {
    "edges": "a tensor at its buffer's first or last byte",
    "shapes": "non-contiguous, broadcast, overlapping, negative-stride and empty tensors inside the buffer",
    "views": "a graph node viewing another tensor (view_src, view_offs)",
    "outside": "a tensor of zero elements below, across or past its buffer or inside another buffer",
}
#: Cases of one check at most (each a write and a read-back of the session's three buffers).
CASES = 8
#: Bytes of the working buffer and of each sentinel.
WORK, SENTINEL = 4096, 1024


@dataclass(frozen=True, slots=True)
class ShadowCheck:
    """One SHADOW check: a command and a geometry class."""

    id: str
    command: C
    klass: str
    majors: tuple[int, ...] = (6, 7, 8)


#: Every SHADOW check, by id: the breakers (a server writing past the class's destinations) are derived from it.
SHADOW_CHECKS: tuple[ShadowCheck, ...] = (
    ShadowCheck("SHADOW-001", C.SET_TENSOR, "edges"),
    ShadowCheck("SHADOW-002", C.SET_TENSOR, "shapes"),
    ShadowCheck("SHADOW-003", C.SET_TENSOR, "outside"),
    ShadowCheck("SHADOW-004", C.SET_TENSOR_2D, "edges", (8,)),
    ShadowCheck("SHADOW-005", C.SET_TENSOR_2D, "shapes", (8,)),
    ShadowCheck("SHADOW-006", C.SET_TENSOR_2D, "outside", (8,)),
    ShadowCheck("SHADOW-007", C.SET_TENSOR_HASH, "edges"),
    ShadowCheck("SHADOW-008", C.SET_TENSOR_HASH, "shapes"),
    ShadowCheck("SHADOW-009", C.COPY_TENSOR, "edges"),
    ShadowCheck("SHADOW-010", C.COPY_TENSOR, "shapes"),
    ShadowCheck("SHADOW-011", C.COPY_TENSOR, "outside"),
    ShadowCheck("SHADOW-012", C.MEMSET_TENSOR, "edges"),
    ShadowCheck("SHADOW-013", C.MEMSET_TENSOR, "shapes"),
    ShadowCheck("SHADOW-014", C.MEMSET_TENSOR, "outside"),
    ShadowCheck("SHADOW-015", C.BUFFER_CLEAR, "edges"),
    ShadowCheck("SHADOW-016", C.INIT_TENSOR, "edges"),
    ShadowCheck("SHADOW-017", C.INIT_TENSOR, "shapes"),
    ShadowCheck("SHADOW-018", C.INIT_TENSOR, "outside"),
    ShadowCheck("SHADOW-019", C.GRAPH_COMPUTE, "edges"),
    ShadowCheck("SHADOW-020", C.GRAPH_COMPUTE, "shapes"),
    ShadowCheck("SHADOW-021", C.GRAPH_COMPUTE, "views"),
    ShadowCheck("SHADOW-022", C.GRAPH_COMPUTE, "outside"),
)
BY_ID = {c.id: c for c in SHADOW_CHECKS}


def in_class(klass: str, g: Geometry) -> bool:
    """Is ``g`` (a drawn or classified geometry) one of the class's cases?"""
    places, shapes = CLASSES[klass]
    if klass == "views":
        return g.view is not None
    return g.place in places and g.shape in shapes and g.view is None


def _combos(ctx: Context, klass: str) -> list[tuple[str, str]]:
    places, shapes = CLASSES[klass]
    combos = [(p, s) for p in places for s in shapes]
    order = ctx.rng().permutation(len(combos))
    picked = [combos[i] for i in order[:CASES]]
    if "other-buffer" in places and not any(p == "other-buffer" for p, _ in picked):
        # A tensor inside another of the session's buffers is the case that shows a write landing there: always one.
        picked[-1] = next(combos[i] for i in order if combos[i][0] == "other-buffer")
    return picked


def _ids(session: ShadowSession) -> Iterator[int]:
    while True:
        yield session.new_id()


def run(ctx: Context, case: ShadowCheck) -> str:
    """The check's cases, one write and one read-back each (a new session after a refusal)."""
    notes: list[str] = []
    session = ShadowSession.open(ctx, WORK, SENTINEL)
    try:
        if case.command is C.BUFFER_CLEAR:
            for value in (0x00, 0xA5):
                req = write_request(ctx.protocol, C.BUFFER_CLEAR, None, session.chooser, session.chooser.rng,
                                    source=session.sentinels[0].span, ids=_ids(session), span=session.work.span)
                assert req is not None
                req.fields["value"] = value
                notes.append(_one(ctx, session, req.command, req.fields, None, f"BUFFER_CLEAR to {value:#04x}",
                                  "whole buffer"))
            return "; ".join(notes)
        for place, shape in _combos(ctx, case.klass):
            # Inside another buffer: inside each of them in turn (whether a server's check lets a write through
            # depends on where that buffer lies, below or above the destination's own).
            for other in range(len(session.buffers) - 1) if place == "other-buffer" else (None,):
                if session.mirror.closed:
                    session.close()
                    session = ShadowSession.open(ctx, WORK, SENTINEL)
                note = _case(ctx, session, case, place, shape, other)
                if note:
                    notes.append(note)
    finally:
        session.close()
    return "; ".join(notes)


def _case(ctx: Context, s: ShadowSession, case: ShadowCheck, place: str, shape: str, other: int | None = None) -> str:
    """One write and its read-back; ``other``: the index (among the session's other buffers) of the one a tensor
    placed "inside another buffer" goes into."""
    c = s.chooser
    graph = case.command is C.GRAPH_COMPUTE
    span = s.work.span
    # A copy's source and a graph's input live in a sentinel: the written tensor is no larger.
    limit = SENTINEL if case.command in (C.COPY_TENSOR, C.GRAPH_COMPUTE) else WORK
    others = s.others(s.work)
    g = draw_geometry(c, span, id=s.new_id(), shape=shape, where=place, types=GRAPH_TYPES if graph else DEFAULT_TYPES,
                      others=others if other is None else others[other:other + 1], alignment=32, max_span=limit)
    view = c.choice(VIEWS[:3]) if case.klass == "views" else None
    req = write_request(ctx.protocol, case.command, g, c, c.rng, source=s.sentinels[0].span, ids=_ids(s), span=span,
                        view=view)
    if req is None:
        return ""
    what = req.describe()
    if req.cached is not None and not _cache(ctx, s, req.cached):
        req.fields["hash"] ^= 1  # no cache on the server: a hash it cannot hold (the oracle judges the miss)
    return _one(ctx, s, req.command, req.fields, req.data, what, req.geometry.klass if req.geometry else "")


def _cache(ctx: Context, s: ShadowSession, data: bytes) -> bool:
    """Put ``data`` in the server's hash cache (a flagged SET_TENSOR into the first sentinel); whether it is there:
    a SET_TENSOR_HASH of it over the same bytes answers a hit."""
    rule = ctx.protocol.cache_rule
    home = s.sentinels[0]
    if rule.flag_field is None or len(data) > home.span.size:
        return False
    t = make_tensor(id=s.new_id(), type=int(GgmlType.I8), ne=(len(data),), buffer=home.span.handle,
                    data=home.span.base)
    # A client flags a SET_TENSOR only after its SET_TENSOR_HASH missed (CACHE-FLAG-NO-MISS): so does the check.
    s.write(C.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": fnv1a64(data)})
    s.write(C.SET_TENSOR, {"tensor": t, "offset": 0, rule.flag_field: 1}, data)
    how, payload = s.write(C.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": fnv1a64(data)})
    return how == "done" and payload[:1] == b"\x01"


def _one(ctx: Context, s: ShadowSession, command: C, fields: dict, data: bytes | None, what: str, klass: str) -> str:
    dest = destination(command, fields, s.mirror.buffers)
    how, _ = s.write(command, fields, data, what=what)
    if how == "refused":
        return f"{klass}: refused"
    s.verify(what, destination=dest, accepted=how == "accepted")
    return f"{klass}: {'accepted where the reference refuses, ' if how == 'accepted' else ''}buffers intact"


def _register(case: ShadowCheck) -> None:
    command = case.command.name
    if case.command is C.BUFFER_CLEAR:
        title = "BUFFER_CLEAR writes its whole buffer and nothing else (sentinels around it keep their bytes)"
    elif case.klass == "outside":
        title = (f"{command} of {CLASS_TEXT['outside']} is refused, or writes nothing in any buffer (the "
                 "session's buffers keep their bytes)")
    else:
        title = (f"{command} of {CLASS_TEXT[case.klass]} writes its destination and nothing else (the session's "
                 "buffers keep every other byte)")

    def body(ctx: Context) -> str:
        return run(ctx, case)

    body.__name__ = f"shadow_{case.id[-3:]}"
    # The shapes and outside classes draw tensors the reference refuses (an empty tensor at the buffer's end, zero
    # elements past it): not for the safe profile.
    _check(case.id, title, DA, level=Level.MUST, majors=case.majors, section=case.command,
           bad_input=case.klass in ("shapes", "outside"))(body)


for _case_ in SHADOW_CHECKS:
    _register(_case_)


__all__ = ["BY_ID", "CASES", "CLASSES", "SHADOW_CHECKS", "ShadowCheck", "in_class", "run"]
