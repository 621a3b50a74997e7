"""Shadow memory: what every byte of every buffer a session allocated must hold, and the oracle that reads back what
a command must not have touched.

What this module may know: the session's *model* (the reference server's own connection state fed the same requests:
a mapping of buffer handles to objects with ``base``, ``size``, ``memory`` and ``epoch``, as
``ggml_rpc.reference.devices.Buffer`` has), the requests' decoded fields, and the bytes a target returned for a read.
It must not know sockets, clients or how a read is sent (the checks' mirror session and the fuzzer's examples do
that), nor any command's effect beyond the few facts below: the reference model says what each command wrote.

How it works:

1. Every buffer of the model is *tracked*: a snapshot of its bytes as last judged and the ranges of bytes the target
   must hold exactly (``known``). A fresh buffer knows nothing (the model's zeros are not the target's bytes); the
   session fills buffers with canaries (known pseudo-random bytes, :func:`canary_bytes`) and :meth:`ShadowMemory.mark`
   makes them known.
2. After every command that may write (:data:`WRITES`), :meth:`ShadowMemory.after` compares the model's memory with
   the snapshots: bytes the model changed are now known (the command wrote them, so the target must hold them too).
   Results of a graph (its nodes' spans, and a COMM_ALLREDUCE's tensor) are not bytes a target must match bit for
   bit: against a target other than the reference itself they become unknown, and so do the bytes a COPY_TENSOR
   copies from unknown ones.
3. :meth:`ShadowMemory.plan` chooses what to read back, bounded per step: the written buffer and its neighbours
   (by the target's addresses when the caller knows them) first, then others; small buffers whole, large ones
   sampled (windows at both edges and in between, said so in a finding).
4. :meth:`ShadowMemory.judge` compares a read with the snapshot over the known bytes: any difference is a
   :class:`Corruption`, naming the buffer, the offset ranges, and the expected and returned bytes.
"""

from __future__ import annotations

import bisect
import random
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from typing import Protocol as Interface

import numpy as np
from ggml_rpc.spec import Command, GgmlOp, GgmlType, Protocol, TensorFlag, fnv1a64, ggml_nbytes, make_tensor
from ggml_rpc.spec.enums import TYPES
from ggml_rpc.spec.geometry import VIEWS, Chooser, Geometry, Span, view_of
from ggml_rpc.spec.tensor import src_ids

#: Commands that may write tensor memory: the oracle looks after each of them.
WRITES = frozenset({Command.SET_TENSOR, Command.SET_TENSOR_2D, Command.SET_TENSOR_HASH, Command.COPY_TENSOR,
                    Command.MEMSET_TENSOR, Command.BUFFER_CLEAR, Command.INIT_TENSOR, Command.GRAPH_COMPUTE,
                    Command.GRAPH_RECOMPUTE, Command.COMM_ALLREDUCE})
#: Commands whose results are computed (not copied): a target other than the reference matches them within a
#: tolerance, never bit for bit.
COMPUTED = frozenset({Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE, Command.COMM_ALLREDUCE})
#: Bytes read back after one command at most (all reads together), and reads at most.
STEP_BYTES = 8192
STEP_READS = 4
#: Bytes of each edge window of a sampled buffer (an overflow lands at an edge first).
EDGE = 64
#: Buffers larger than this are sampled, never read whole.
WHOLE_LIMIT = 4096
#: Model bytes tracked per connection at most (snapshots cost as much again): buffers beyond are not judged.
TRACK_LIMIT = 32 << 20


class BufferLike(Interface):
    """What the oracle reads of a model buffer."""

    base: int
    size: int
    memory: np.ndarray
    epoch: int


# ---- byte ranges ------------------------------------------------------------------------------------------------


class Ranges:
    """A set of byte offsets as sorted, disjoint, non-adjacent half-open ranges."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        for lo, hi in ranges:
            self.add(lo, hi)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._lo, self._hi, strict=True))

    def __len__(self) -> int:
        return len(self._lo)

    def __repr__(self) -> str:
        return f"Ranges({list(self)})"

    @property
    def total(self) -> int:
        return sum(h - lo for lo, h in self)

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        i = bisect.bisect_left(self._hi, lo)  # first range ending at or after lo (touching ones merge)
        j = bisect.bisect_right(self._lo, hi)  # ranges starting at or before hi
        if i < j:
            lo = min(lo, self._lo[i])
            hi = max(hi, self._hi[j - 1])
        self._lo[i:j] = [lo]
        self._hi[i:j] = [hi]

    def remove(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        i = bisect.bisect_right(self._hi, lo)
        j = bisect.bisect_left(self._lo, hi)
        keep_lo: list[int] = []
        keep_hi: list[int] = []
        if i < j:
            if self._lo[i] < lo:
                keep_lo.append(self._lo[i])
                keep_hi.append(lo)
            if self._hi[j - 1] > hi:
                keep_lo.append(hi)
                keep_hi.append(self._hi[j - 1])
        self._lo[i:j] = keep_lo
        self._hi[i:j] = keep_hi

    def clip(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The ranges inside [lo, hi)."""
        i = bisect.bisect_right(self._hi, lo)
        out = []
        while i < len(self._lo) and self._lo[i] < hi:
            out.append((max(lo, self._lo[i]), min(hi, self._hi[i])))
            i += 1
        return out

    def mask(self, lo: int, hi: int) -> np.ndarray:
        """A boolean mask of [lo, hi): True where the offset is in the set."""
        m = np.zeros(max(0, hi - lo), dtype=bool)
        for a, b in self.clip(lo, hi):
            m[a - lo : b - lo] = True
        return m


def runs(flags: np.ndarray, offset: int = 0) -> list[tuple[int, int]]:
    """The ranges of True values of a boolean array, shifted by ``offset``."""
    if not flags.any():
        return []
    padded = np.concatenate(([False], flags, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a) + offset, int(b) + offset) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def canary_bytes(n: int, seed: int) -> bytes:
    """``n`` pseudo-random bytes (a canary), different for every seed; no byte is zero, so a zeroed byte shows."""
    rng = np.random.default_rng(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return (rng.integers(1, 256, size=n, dtype=np.uint8)).tobytes()


# ---- what one command may have written -------------------------------------------------------------------------


def _tensor_list(tensors: Any) -> list[dict[str, Any]]:
    if isinstance(tensors, np.ndarray):
        names = tensors.dtype.names or ()
        return [{n: (row[n].tolist() if hasattr(row[n], "tolist") else row[n]) for n in names} for row in tensors]
    return list(tensors or ())


def tensor_span(t: Mapping[str, Any], buffers: Mapping[int, BufferLike]) -> tuple[int, int, int] | None:
    """(handle, start, end) of the bytes a tensor spans inside its buffer (clipped to it), or None."""
    buf = buffers.get(int(t["buffer"])) if t.get("buffer") else None
    if buf is None or t["type"] not in TYPES or TYPES[t["type"]].blck == 0:
        return None
    try:
        n = ggml_nbytes(int(t["type"]), [int(v) for v in t["ne"]], [int(v) for v in t["nb"]])
    except (KeyError, ValueError):
        return None
    lo = int(t["data"]) - buf.base
    hi = lo + n
    lo, hi = max(0, lo), min(buf.size, hi)
    if hi <= lo:
        return None
    return int(t["buffer"]), lo, hi


def computed_spans(command: Command, fields: Mapping[str, Any],
                   buffers: Mapping[int, BufferLike]) -> list[tuple[int, int, int]]:
    """Spans a computing command may write (GRAPH_COMPUTE: every node's; COMM_ALLREDUCE: its tensor's)."""
    if command is Command.GRAPH_COMPUTE:
        nodes = {int(n) for n in fields.get("nodes", ())}
        spans = [tensor_span(t, buffers) for t in _tensor_list(fields.get("tensors")) if int(t["id"]) in nodes]
        return [s for s in spans if s is not None]
    if command is Command.COMM_ALLREDUCE and isinstance(fields.get("tensor"), Mapping):
        s = tensor_span(fields["tensor"], buffers)
        return [s] if s is not None else []
    return []


# ---- the oracle -------------------------------------------------------------------------------------------------


@dataclass
class Tracked:
    """One model buffer under watch."""

    handle: int
    base: int
    size: int
    #: Order of allocation on the connection (1 = first): how a finding names the buffer.
    number: int
    snapshot: np.ndarray
    known: Ranges = field(default_factory=Ranges)
    epoch: int = -1
    #: What the session uses the buffer for ("sentinel before the working buffer", ...): said in findings.
    role: str = ""

    def label(self) -> str:
        role = f", {self.role}" if self.role else ""
        return f"buffer #{self.number} ({self.size} bytes{role})"


@dataclass(frozen=True, slots=True)
class Read:
    """A read-back of one buffer: ``copies`` windows of ``size`` bytes, ``stride`` apart, from ``offset``."""

    handle: int
    offset: int
    size: int
    copies: int = 1
    stride: int = 0
    #: Part of a sampled (not whole) read of its buffer.
    sampled: bool = False

    @property
    def nbytes(self) -> int:
        return self.size * self.copies

    def windows(self) -> list[tuple[int, int]]:
        return [(self.offset + k * self.stride, self.offset + k * self.stride + self.size)
                for k in range(self.copies)]


@dataclass
class Corruption:
    """Bytes a target returned that differ from what the shadow says a buffer holds."""

    handle: int
    buffer: str
    #: Offset ranges (inside the buffer) that differ.
    ranges: list[tuple[int, int]]
    expected: bytes
    got: bytes
    #: Offset of ``expected``/``got``'s first byte.
    at: int
    #: Bytes compared in this read, and the buffer's size (a sampled read compares part of it).
    compared: int
    size: int
    sampled: bool
    #: How the changed bytes relate to the command's own destination ("another buffer", ...).
    where: str = ""

    @property
    def changed(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def spans_text(self, most: int = 4) -> str:
        parts = [f"[{a}, {b})" for a, b in self.ranges[:most]]
        if len(self.ranges) > most:
            parts.append(f"and {len(self.ranges) - most} more")
        return ", ".join(parts)

    def describe(self) -> str:
        sample = (f"; sampled: {self.compared} of its {self.size} bytes compared" if self.sampled else "")
        return (f"{self.buffer}, {self.where or 'a buffer of the session'}: {self.changed} byte(s) changed at "
                f"{self.spans_text()} (expected {self.expected.hex(' ')}, got {self.got.hex(' ')}){sample}")

    def to_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer, "where": self.where, "ranges": [list(r) for r in self.ranges],
                "expected": self.expected.hex(), "got": self.got.hex(), "at": self.at, "compared": self.compared,
                "size": self.size, "sampled": self.sampled}


class ShadowMemory:
    """The shadow of one connection's buffers, over the model's own buffer table (read, never written)."""

    def __init__(self, buffers: Mapping[int, BufferLike], *, exact: bool = False, seed: int = 0,
                 track_limit: int = TRACK_LIMIT) -> None:
        self.buffers = buffers
        #: The target is the reference itself: computed bytes are compared bit for bit too.
        self.exact = exact
        self.tracked: dict[int, Tracked] = {}
        self.rng = random.Random(seed)
        self._allocated = 0
        self._bytes = 0
        self._limit = track_limit
        #: Spans of the graphs computed on this connection, per device: what a GRAPH_RECOMPUTE may write.
        self._graphs: dict[int, list[tuple[int, int, int]]] = {}
        #: Handles the last command's destination lies in (read first).
        self.focus: list[int] = []

    # ---- tracking ------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Start tracking the model's new buffers (nothing known yet), forget freed ones."""
        for handle in [h for h in self.tracked if h not in self.buffers]:
            gone = self.tracked.pop(handle)
            self._bytes -= gone.size
        for handle, buf in self.buffers.items():
            if handle in self.tracked:
                continue
            self._allocated += 1
            if buf.size == 0 or self._bytes + buf.size > self._limit:
                continue
            t = Tracked(handle, buf.base, buf.size, self._allocated, np.array(buf.memory, dtype=np.uint8, copy=True),
                        epoch=buf.epoch)
            if self.exact:
                t.known.add(0, buf.size)  # the target is the reference itself: its fresh buffers are the model's
            self.tracked[handle] = t
            self._bytes += buf.size

    def mark(self, handle: int, lo: int = 0, hi: int | None = None, *, role: str | None = None) -> None:
        """The bytes [lo, hi) of a buffer hold what the model holds (a canary the session wrote to both sides)."""
        self.sync()
        t = self.tracked.get(handle)
        if t is None:
            return
        self._refresh(t)
        t.known.add(max(0, lo), min(t.size, t.size if hi is None else hi))
        if role is not None:
            t.role = role

    def role(self, handle: int, role: str) -> None:
        t = self.tracked.get(handle)
        if t is not None:
            t.role = role

    def _refresh(self, t: Tracked, *, learn: bool = True) -> np.ndarray | None:
        """Take the model's bytes of ``t`` into its snapshot; the offsets that changed (``learn``: now known)."""
        buf = self.buffers.get(t.handle)
        if buf is None:
            return None
        mem = np.asarray(buf.memory, dtype=np.uint8)
        changed = mem != t.snapshot
        if changed.any():
            if learn:
                for lo, hi in runs(changed):
                    t.known.add(lo, hi)
            t.snapshot[:] = mem
        t.epoch = buf.epoch
        return changed

    def after(self, command: Command, fields: Mapping[str, Any]) -> None:
        """Learn what ``command`` (the model ran it without closing) wrote: bytes it changed are known, a graph's
        results are not (unless the target is the reference itself)."""
        self.sync()
        computed = command in COMPUTED
        spans: list[tuple[int, int, int]] = []
        if command is Command.GRAPH_COMPUTE:
            spans = computed_spans(command, fields, self.buffers)
            self._graphs.setdefault(int(fields.get("device", 0)), []).extend(spans)
        elif command is Command.GRAPH_RECOMPUTE:
            spans = list(self._graphs.get(int(fields.get("device", 0)), ()))
        elif command is Command.COMM_ALLREDUCE:
            spans = computed_spans(command, fields, self.buffers)
        unknown_copy = self._copied_unknown(command, fields)
        for t in self.tracked.values():
            buf = self.buffers.get(t.handle)
            if buf is None or (not computed and buf.epoch == t.epoch):
                continue
            self._refresh(t)
        if computed and not self.exact:
            for handle, lo, hi in spans:
                t = self.tracked.get(handle)
                if t is not None:
                    t.known.remove(lo, hi)
        for handle, lo, hi in unknown_copy:
            t = self.tracked.get(handle)
            if t is not None:
                t.known.remove(lo, hi)
        self.focus = self._destinations(command, fields, spans)

    def _copied_unknown(self, command: Command, fields: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        """COPY_TENSOR: the destination bytes copied from source bytes the target need not match."""
        if command is not Command.COPY_TENSOR:
            return []
        dst, src = fields["dst"], fields["src"]
        dbuf = self.buffers.get(int(dst["buffer"])) if dst.get("buffer") else None
        span = tensor_span(src, self.buffers)
        if dbuf is None or span is None:
            return []
        handle, lo, hi = span
        d0 = int(dst["data"]) - dbuf.base - lo
        t = self.tracked.get(handle)
        if t is None:  # a source the oracle does not watch: nothing copied from it is known
            return [(int(dst["buffer"]), d0 + lo, d0 + hi)]
        return [(int(dst["buffer"]), d0 + a, d0 + b) for a, b in runs(~t.known.mask(lo, hi), lo)]

    def _destinations(self, command: Command, fields: Mapping[str, Any],
                      spans: list[tuple[int, int, int]]) -> list[int]:
        handles = [h for h, _, _ in spans]
        for key in ("tensor", "dst"):
            t = fields.get(key)
            if isinstance(t, Mapping) and t.get("buffer"):
                handles.append(int(t["buffer"]))
        if "remote_ptr" in fields:
            handles.append(int(fields["remote_ptr"]))
        return [h for h in dict.fromkeys(handles) if h in self.tracked]

    # ---- reads ---------------------------------------------------------------------------------------------

    def plan(self, *, order: Sequence[int] = (), budget: int = STEP_BYTES, reads: int = STEP_READS,
             two_d: bool = False, readable: Collection[int] | None = None) -> list[Read]:
        """What to read back after a command: the destination's buffer, then its neighbours in ``order`` (model
        handles sorted by the target's addresses, when known), then others at random; bounded by ``budget`` bytes
        and ``reads`` reads. ``two_d``: the target has GET_TENSOR_2D (a sampled buffer in one read); ``readable``:
        the buffers a read can name on the target (those whose address there is known), None for all."""
        picked: list[int] = []
        for h in self.focus:
            picked.append(h)
            if h in order:
                i = list(order).index(h)
                picked += [order[j] for j in (i - 1, i + 1) if 0 <= j < len(order)]
        rest = [h for h in self.tracked if h not in picked and self.tracked[h].known.total]
        self.rng.shuffle(rest)
        picked += rest
        out: list[Read] = []
        left = budget
        for h in dict.fromkeys(picked):
            t = self.tracked.get(h)
            if t is None or not t.known.total or (readable is not None and h not in readable):
                continue
            if len(out) >= reads or left <= 0:
                break
            for r in self._reads_of(t, min(left, max(EDGE * 2, budget // 2)), two_d):
                if len(out) >= reads or r.nbytes > left:
                    break
                out.append(r)
                left -= r.nbytes
        return out

    def _reads_of(self, t: Tracked, budget: int, two_d: bool) -> list[Read]:
        lo, hi = next(iter(t.known))[0], list(t.known)[-1][1]
        if hi - lo <= min(budget, WHOLE_LIMIT):
            return [Read(t.handle, lo, hi - lo)]
        # Sampled: both edges of the known bytes, then windows in between.
        edge = min(EDGE, (hi - lo) // 2)
        if two_d:
            copies = max(2, min(64, budget // edge))
            stride = max(edge, (hi - lo - edge) // (copies - 1))
            copies = min(copies, (hi - lo - edge) // stride + 1)
            out = [Read(t.handle, lo, edge, copies, stride, sampled=True)]
            if lo + (copies - 1) * stride + edge < hi:  # the top edge, where the windows stopped short of it
                out.append(Read(t.handle, hi - edge, edge, sampled=True))
            return out
        out = [Read(t.handle, hi - edge, edge, sampled=True), Read(t.handle, lo, edge, sampled=True)]
        mid = budget - 2 * edge
        if mid >= EDGE:
            start = self.rng.randrange(lo + edge, max(lo + edge + 1, hi - edge - mid + 1))
            out.append(Read(t.handle, start, min(mid, hi - edge - start), sampled=True))
        return [r for r in out if r.size > 0]

    def expected(self, read: Read) -> bytes:
        """What the target must return for ``read`` where bytes are known (the model's bytes)."""
        t = self.tracked[read.handle]
        return b"".join(t.snapshot[a:b].tobytes() for a, b in read.windows())

    def judge(self, read: Read, got: bytes | bytearray | memoryview, *,
              destination: tuple[int, int, int] | None = None) -> Corruption | None:
        """Compare a read with the shadow over its known bytes. ``destination``: (handle, lo, hi) the command
        was meant to write (to say where the changed bytes lie)."""
        t = self.tracked.get(read.handle)
        if t is None:
            return None
        g = np.frombuffer(bytes(got), dtype=np.uint8)
        pos = 0
        bad: list[tuple[int, int]] = []
        compared = 0
        for a, b in read.windows():
            b = min(b, t.size)
            if b <= a:
                continue
            part = g[pos : pos + (b - a)]
            pos += b - a
            if len(part) < b - a:
                break
            known = t.known.mask(a, b)
            compared += int(known.sum())
            differ = (part != t.snapshot[a:b]) & known
            bad += runs(differ, a)
        if not bad:
            return None
        first = bad[0][0]
        windows = read.windows()
        k = next(i for i, (a, b) in enumerate(windows) if a <= first < b)
        w0, w1 = windows[k]
        lo = max(w0, first - 8)
        n = min(32, min(w1, t.size) - lo)
        at = k * read.size + (lo - w0)
        return Corruption(t.handle, t.label(), bad, t.snapshot[lo : lo + n].tobytes(), bytes(g[at : at + n]), lo,
                          compared, t.size, read.sampled or compared < t.size, self._where(t, bad, destination))

    @staticmethod
    def _where(t: Tracked, bad: list[tuple[int, int]], destination: tuple[int, int, int] | None) -> str:
        if destination is None:
            return ""
        handle, lo, hi = destination
        if handle != t.handle:
            return "another buffer than the destination's"
        if all(lo <= a and b <= hi for a, b in bad):
            return "inside the destination (wrong bytes written)"
        return "the destination's buffer, outside the destination"


# ---- one write through a drawn geometry --------------------------------------------------------------------------

#: Graph ops of a written node: one source of the node's own shape, copied or scaled (results any server computes
#: exactly, and the reference executes).
GRAPH_OPS = (GgmlOp.DUP, GgmlOp.CPY, GgmlOp.SCALE, GgmlOp.ADD, GgmlOp.CONT)
#: Shapes every op of :data:`GRAPH_OPS` computes (the others are copied: DUP takes any strides).
ROW_SHAPES = ("contiguous", "one-element", "block-edge", "padded", "negative-unit")
#: Node types of a written graph node.
GRAPH_TYPES = (int(GgmlType.F32), int(GgmlType.F16))


@dataclass
class WriteRequest:
    """A write-capable request through one drawn geometry: its fields, bulk data, and the geometry written."""

    command: Command
    fields: dict[str, Any]
    data: bytes | None
    geometry: Geometry | None
    #: Bytes the server's hash cache must hold first (SET_TENSOR_HASH), or None.
    cached: bytes | None = None

    def describe(self) -> str:
        what = self.command.name
        return f"{what} of {self.geometry.describe()}" if self.geometry is not None else what


def write_request(protocol: Protocol, command: Command, g: Geometry | None, c: Chooser, rng: random.Random, *,
                  source: Span, ids: Iterator[int], span: Span | None = None,
                  view: str | None = None) -> WriteRequest | None:
    """One request of ``command`` whose destination is the tensor ``g`` (BUFFER_CLEAR: the whole ``span``).

    ``source`` is a buffer whose first bytes the request may read (COPY_TENSOR's source, a graph's input); ``view``
    makes a graph's node a view of ``g`` (a class of :data:`~ggml_rpc.spec.geometry.VIEWS`). None when the
    geometry leaves nothing to build (a graph input that does not fit ``source``)."""
    flag = protocol.cache_rule.flag_field
    if command is Command.BUFFER_CLEAR:
        target = span if span is not None else (g.span if g is not None else None)
        if target is None:
            return None
        return WriteRequest(command, {"remote_ptr": target.handle, "value": rng.randrange(256)}, None, None)
    if g is None:
        return None
    t, n = g.fields, g.nbytes
    if command is Command.SET_TENSOR:
        offset = 0
        if n > 1 and rng.random() < 0.3:
            offset = n - c.choice((1, min(n, 4), min(n, 32)))  # the tail, up to the tensor's last byte
        fields: dict[str, Any] = {"tensor": t, "offset": offset}
        if flag:
            fields[flag] = 0
        return WriteRequest(command, fields, rng.randbytes(max(0, n - offset)), g)
    if command is Command.SET_TENSOR_2D:
        rows = max(1, int(t["ne"][1]) * int(t["ne"][2]) * int(t["ne"][3]))
        row = max(1, n // rows) if n else 1
        stride = max(row, int(t["nb"][1])) if rows > 1 else 0
        if n and (rows - 1) * stride + row > n:
            rows, stride, row = 1, 0, n
        fields = {"tensor": t, "offset": 0, "size": row, "n_copies": rows, "stride": stride}
        return WriteRequest(command, fields, rng.randbytes(row * rows), g)
    if command is Command.SET_TENSOR_HASH:
        data = rng.randbytes(max(1, n))
        return WriteRequest(command, {"tensor": t, "offset": 0, "hash": fnv1a64(data)}, None, g, cached=data)
    if command is Command.MEMSET_TENSOR:
        return WriteRequest(command, {"tensor": t, "offset": 0, "size": n, "value": rng.randrange(256)}, None, g)
    if command is Command.INIT_TENSOR:
        return WriteRequest(command, {"tensor": t}, None, g)
    if command is Command.COMM_ALLREDUCE:
        return WriteRequest(command, {"device": 0, "tensor": t}, None, g)
    if command is Command.COPY_TENSOR:
        src = make_tensor(id=next(ids), type=int(GgmlType.I8), ne=(max(1, min(n, source.size)),),
                          buffer=source.handle, data=source.base)
        return WriteRequest(command, {"src": src, "dst": t}, None, g)
    if command is not Command.GRAPH_COMPUTE:
        raise ValueError(f"{command.name} writes no tensor")
    node_g = view_of(c, g, id=next(ids), view=view) if view is not None else g
    node = node_g.fields
    src = make_tensor(id=next(ids), type=node["type"], ne=tuple(node["ne"]), buffer=source.handle, data=source.base)
    if node_g.nbytes > source.size or ggml_nbytes(src["type"], src["ne"], src["nb"]) > source.size:
        return None
    # Kernels other than a copy's take rows of whole elements one after another: a node of another shape is copied.
    op = c.choice(GRAPH_OPS) if g.shape in ROW_SHAPES or g.shape.startswith("empty") else GgmlOp.DUP
    if op is GgmlOp.CPY and view is None:
        op = GgmlOp.DUP  # a copy's result is a view of its second source: without a view, a plain copy
    params = [0] * 16
    if op is GgmlOp.SCALE:
        params[0] = struct.unpack("<i", struct.pack("<f", c.choice((0.5, 2.0, -1.0))))[0]
    srcs = {GgmlOp.ADD: [src["id"], src["id"]], GgmlOp.CPY: [src["id"], t["id"]]}.get(op, [src["id"]])
    node = dict(node, op=int(op), flags=int(TensorFlag.COMPUTE), src=src_ids(*srcs), op_params=params)
    tensors = [src, *([dict(t)] if view is not None else []), node]
    fields = {"device": 0, "nodes": [node["id"]], "tensors": tensors}
    if protocol.graph_cache_max is not None:
        fields["uid"] = 1  # 8.0.0: the graph is kept under a uid (one a GRAPH_RECOMPUTE may name)
    return WriteRequest(command, fields, None, node_g)


def destination(command: Command, fields: Mapping[str, Any],
                buffers: Mapping[int, BufferLike]) -> tuple[int, int, int] | None:
    """(handle, lo, hi): the bytes a write was meant to write, inside its buffer."""
    if command is Command.BUFFER_CLEAR:
        buf = buffers.get(int(fields.get("remote_ptr", 0)))
        return (int(fields["remote_ptr"]), 0, buf.size) if buf is not None else None
    t = written_tensor(command, fields)
    if t is None:
        return None
    span = tensor_span(t, buffers)
    if span is None:
        return None
    handle, lo, hi = span
    if command in (Command.SET_TENSOR, Command.MEMSET_TENSOR, Command.SET_TENSOR_2D) and "offset" in fields:
        lo = lo + int(fields["offset"])
    return handle, lo, hi


def written_tensor(command: Command, fields: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The tensor a write names as its destination (a graph: its first node)."""
    for key in ("dst", "tensor"):
        t = fields.get(key)
        if isinstance(t, Mapping):
            return t
    if command is Command.GRAPH_COMPUTE:
        nodes = {int(n) for n in fields.get("nodes", ())}
        for t in _tensor_list(fields.get("tensors")):
            if int(t["id"]) in nodes:
                return t
    return None


__all__ = ["COMPUTED", "GRAPH_OPS", "GRAPH_TYPES", "STEP_BYTES", "STEP_READS", "VIEWS", "WRITES", "BufferLike",
           "Corruption", "Ranges", "Read", "ShadowMemory", "Tracked", "WriteRequest", "canary_bytes", "computed_spans",
           "destination", "runs", "tensor_span", "write_request", "written_tensor"]
