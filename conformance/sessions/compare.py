"""How a replayed reply is compared with the recorded one, and what the comparisons found.

Replies are compared by class:

* ``exact``: HELLO version (major.minor), data read back before any compute, SET_TENSOR_HASH hit/miss given the
  cache state, COPY_TENSOR result, ALLOC_BUFFER success;
* ``recorded``: server-specific values, kept but not compared (alignment, max size, memory, alloc sizes, handles,
  bases, device count, supports-op answers);
* ``computed``: GET_TENSOR after a GRAPH_COMPUTE/GRAPH_RECOMPUTE on the connection (unless it reads back exactly a
  region written since that graph ran), compared within a normalised mean squared error for float tensors (exactly
  for other types);
* ``close``: the recorded server closed instead of replying; the target must close too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from ggml_rpc.conformance.nmse import nmse
from ggml_rpc.spec import Command, GgmlType, Protocol, Reply, Request, tensor_name
from ggml_rpc.spec.layout import flat_layout

from .decode import DecodedConnection
from .spans import WINDOW, LazyBytes

if TYPE_CHECKING:
    from .relocate import Relocator, TargetCache

#: Default tolerance for computed reads (normalised mean squared error, as ggml's backend tests use).
DEFAULT_NMSE = 1e-6

RECORDED_ONLY = frozenset({
    Command.GET_ALIGNMENT, Command.GET_MAX_SIZE, Command.GET_DEVICE_MEMORY, Command.GET_ALLOC_SIZE,
    Command.BUFFER_GET_BASE, Command.DEVICE_COUNT, Command.GET_DEVICE_SUPPORTS_OP,
})
#: Types whose computed reads are compared within a tolerance (numpy dtype of their elements).
#: Computed reads compared by NMSE, by ggml type: numpy's dtype of the stored values (BF16, which numpy lacks, as its
#: raw 16-bit patterns, widened by :func:`float_values`).
FLOAT_TYPES = {int(GgmlType.F32): np.dtype("<f4"), int(GgmlType.F16): np.dtype("<f2"),
               int(GgmlType.F64): np.dtype("<f8"), int(GgmlType.BF16): np.dtype("<u2")}


def float_values(buf: memoryview | bytes, dtype: np.dtype) -> np.ndarray:
    """The values of a float read as float64 (a BF16 value is the top half of a float32)."""
    raw = np.frombuffer(buf, dtype=dtype)
    if dtype.kind == "u":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


@dataclass
class Mismatch:
    """A reply that differs from the recorded one."""

    file: str
    connection: int
    index: int
    command: str
    kind: str  # exact / computed / close / transport
    expected: str
    got: str

    def line(self) -> str:
        return (f"{self.file} connection {self.connection} message {self.index} {self.command} [{self.kind}]: "
                f"expected {self.expected}, got {self.got}")


@dataclass
class ReplayReport:
    """What a replay did and found."""

    target: str
    source_versions: list[str] = field(default_factory=list)
    target_version: str = ""
    connections: int = 0
    requests: int = 0
    compared: dict[str, int] = field(default_factory=lambda: {"exact": 0, "computed": 0, "recorded": 0,
                                                              "close": 0})
    mismatches: list[Mismatch] = field(default_factory=list)
    #: Where a capture ends inside a message: that connection was replayed up to there only (not a mismatch of the
    #: target, but not a complete replay either: it fails the run).
    cuts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    worst_nmse: float = 0.0
    #: Per op of the graph node whose result was read (op_closeness.py): reads compared and their worst NMSE.
    nmse_by_op: dict[str, dict[str, Any]] = field(default_factory=dict)

    def note_op(self, op: tuple[str, str] | None, err: float) -> None:
        """One float read of (op, source 0's type)'s result compared, at NMSE ``err``."""
        if op is None:
            return
        fig = self.nmse_by_op.setdefault(op[0], {"reads": 0, "worst_nmse": 0.0, "by_src0_type": {}})
        sub = fig["by_src0_type"].setdefault(op[1], {"reads": 0, "worst_nmse": 0.0})
        for f in (fig, sub):
            f["reads"] += 1
            f["worst_nmse"] = max(f["worst_nmse"], err)

    def note_exact(self, op: tuple[str, str] | None, same: bool) -> None:
        """One read of a result that is not a float (indices, counts, quantised blocks), compared byte for byte."""
        if op is None:
            return
        fig = self.nmse_by_op.setdefault(op[0], {"reads": 0, "worst_nmse": 0.0, "by_src0_type": {}})
        fig["exact_reads"] = fig.get("exact_reads", 0) + 1
        fig["exact_differ"] = fig.get("exact_differ", 0) + (not same)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.cuts

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def first_difference(a: memoryview, b: memoryview) -> str:
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    at = int(diff[0]) if len(diff) else n
    return f"first difference at byte {at} ({len(diff)} differing bytes of {n})"


def same_bytes(a: memoryview | bytes, b: memoryview | bytes) -> bool:
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    return x.shape == y.shape and bool(np.array_equal(x, y))


def _slices(data: memoryview | LazyBytes, size: int = WINDOW) -> Iterator[memoryview]:
    if isinstance(data, LazyBytes):
        return data.slices(size)
    mv = memoryview(data).cast("B")
    return (mv[i : i + size] for i in range(0, mv.nbytes, size))


class _ReadDiff:
    """A comparison of two reads fed slice by slice: equality, the first differing byte, and the NMSE of a float
    read accumulated as its two sums (``nmse``'s definition, kept over slices so a large read is never whole)."""

    def __init__(self, dtype: np.dtype | None) -> None:
        self.dtype = dtype
        self.n = 0
        self.first: int | None = None
        self.differing = 0
        self.num = 0.0
        self.den = 0.0
        self.infinite = False

    def add(self, want: memoryview, got: memoryview) -> None:
        x, y = np.frombuffer(want, dtype=np.uint8), np.frombuffer(got, dtype=np.uint8)
        if not np.array_equal(x, y):
            diff = np.flatnonzero(x != y)
            if self.first is None:
                self.first = self.n + int(diff[0])
            self.differing += len(diff)
        self.n += len(x)
        if self.dtype is not None:
            e, g = float_values(want, self.dtype), float_values(got, self.dtype)
            fe, fg = np.isfinite(e), np.isfinite(g)
            if not np.array_equal(fe, fg):
                self.infinite = True
                return
            if not fe.all():
                e_bad, g_bad = e[~fe], g[~fe]
                if not np.all((e_bad == g_bad) | (np.isnan(e_bad) & np.isnan(g_bad))):
                    self.infinite = True
                    return
                e, g = e[fe], g[fe]
            d = g - e
            self.num += float(np.dot(d, d))
            self.den += float(np.dot(e, e))

    @property
    def same(self) -> bool:
        return self.first is None

    def first_difference(self) -> str:
        return f"first difference at byte {self.first} ({self.differing} differing bytes of {self.n})"

    def nmse(self) -> float:
        if self.infinite:
            return float("inf")
        return self.num / self.den if self.den else self.num


def tensor_label(t: dict[str, Any]) -> str:
    return tensor_name(t["name"]) or f"id={t['id']:#x}"


class ReplyComparer:
    """Compares each reply of the target with the recorded one, by class, counting into one report."""

    def __init__(self, target: Protocol, report: ReplayReport, cache: TargetCache, tolerance: float) -> None:
        self.target = target
        self.report = report
        self.cache = cache
        self.tolerance = tolerance

    def mismatch(self, path: str, dc: DecodedConnection, req: Request, kind: str, expected: str, got: str) -> None:
        self.report.mismatches.append(Mismatch(path, dc.conn.index, req.index, req.command.name, kind, expected, got))

    def reply(self, path: str, dc: DecodedConnection, req: Request, rec: Reply, got: memoryview, computed: bool,
              reloc: Relocator, op: tuple[str, str] | None = None) -> None:
        """Compare ``got`` (the target's reply body to ``req``) with ``rec``, learning relocations on the way;
        ``op``: the op that computed the tensor read, when known (its closeness is counted under that name)."""
        cmd = req.command
        spec = self.target.spec(cmd)
        assert spec is not None and spec.reply
        if cmd is Command.GET_TENSOR:
            assert rec.data is not None
            # Reads reach here whole only up to the replayer's slice size: the recorded one is read in as well.
            want = memoryview(rec.data.read()) if isinstance(rec.data, LazyBytes) else rec.data
            self._read(path, dc, req, want, got, computed, op)
            return
        got_fields = flat_layout(spec.reply.schema).unpack(got)  # type: ignore[union-attr]
        want = rec.fields
        if cmd is Command.ALLOC_BUFFER:
            reloc.buffer(want["remote_ptr"], got_fields["remote_ptr"])
            self._exact(path, dc, req, "a successful allocation" if want["remote_ptr"] else "a failed allocation",
                        "success" if got_fields["remote_ptr"] else "failure (remote_ptr 0)",
                        bool(want["remote_ptr"]) == bool(got_fields["remote_ptr"]))
            return
        if cmd is Command.BUFFER_GET_BASE:
            reloc.base(req.fields["remote_ptr"], want["base_ptr"], got_fields["base_ptr"])
        if cmd in RECORDED_ONLY:
            self.report.compared["recorded"] += 1
            return
        if cmd is Command.HELLO:
            version = f"{self.target.version[0]}.{self.target.version[1]}"
            got_v = f"{got_fields['major']}.{got_fields['minor']}"
            self._exact(path, dc, req, f"version {version}.x", f"version {got_v}.{got_fields['patch']}",
                        version == got_v)
            return
        if cmd is Command.SET_TENSOR_HASH:
            expect_hit = bool(want["result"]) or self.cache.holds(req.fields["hash"])
            hit = bool(got_fields["result"])
            why = "" if expect_hit == bool(want["result"]) else " (the replay saved this payload earlier)"
            self._exact(path, dc, req, ("hit" if expect_hit else "miss") + why, "hit" if hit else "miss",
                        hit == expect_hit)
            return
        self._exact(path, dc, req, str(dict(want)), str(dict(got_fields)), dict(want) == dict(got_fields))

    def large_read(self, path: str, dc: DecodedConnection, req: Request, rec: Reply, got: Iterable[memoryview],
                   computed: bool, op: tuple[str, str] | None = None) -> None:
        """A read too large to hold, compared as :meth:`reply` compares it, slice by slice: ``got`` yields the
        target's reply body in slices as it arrives, the recorded one is read from the capture alongside."""
        if req.command is not Command.GET_TENSOR:
            # Rows (GET_TENSOR_2D) compare their (empty) reply fields only, as :meth:`reply` does.
            self._exact(path, dc, req, str(dict(rec.fields)), "{}", dict(rec.fields) == {})
            return
        assert rec.data is not None
        t = req.fields["tensor"]
        want = rec.data
        dtype = FLOAT_TYPES.get(t["type"]) if computed else None
        if dtype is not None and want.nbytes % dtype.itemsize:
            dtype = None
        diff = _ReadDiff(dtype)
        for a, b in zip(_slices(want), got, strict=False):
            diff.add(a, b)
        self.report.compared["computed" if computed else "exact"] += 1
        if computed and dtype is None:
            self.report.note_exact(op, diff.same)
        if diff.same:
            if computed and dtype is not None:
                self.report.note_op(op, 0.0)
            return
        if not computed:
            self.mismatch(path, dc, req, "exact", f"the {want.nbytes} bytes written to {tensor_label(t)}",
                          diff.first_difference())
        elif dtype is None:
            self.mismatch(path, dc, req, "computed", f"the recorded {want.nbytes} bytes of {tensor_label(t)} "
                          "(not a float type: exact)", diff.first_difference())
        else:
            err = diff.nmse()
            self.report.worst_nmse = max(self.report.worst_nmse, err)
            self.report.note_op(op, err)
            if not err <= self.tolerance:
                self.mismatch(path, dc, req, "computed", f"{tensor_label(t)} within NMSE {self.tolerance:g}",
                              f"NMSE {err:.3g}")

    def _exact(self, path: str, dc: DecodedConnection, req: Request, expected: str, got: str, ok: bool) -> None:
        self.report.compared["exact"] += 1
        if not ok:
            self.mismatch(path, dc, req, "exact", expected, got)

    def _read(self, path: str, dc: DecodedConnection, req: Request, want: memoryview, got: memoryview,
              computed: bool, op: tuple[str, str] | None = None) -> None:
        t = req.fields["tensor"]
        if not computed:
            self.report.compared["exact"] += 1
            if not same_bytes(want, got):
                self.mismatch(path, dc, req, "exact", f"the {want.nbytes} bytes written to {tensor_label(t)}",
                              first_difference(want, got))
            return
        self.report.compared["computed"] += 1
        dtype = FLOAT_TYPES.get(t["type"])
        if dtype is not None and want.nbytes % dtype.itemsize:
            dtype = None
        same = same_bytes(want, got)
        if dtype is None:
            self.report.note_exact(op, same)
        if same:
            if dtype is not None:
                self.report.note_op(op, 0.0)
            return
        if dtype is None:
            self.mismatch(path, dc, req, "computed", f"the recorded {want.nbytes} bytes of {tensor_label(t)} "
                          "(not a float type: exact)", first_difference(want, got))
            return
        err = nmse(float_values(want, dtype), float_values(got, dtype))
        self.report.worst_nmse = max(self.report.worst_nmse, err)
        self.report.note_op(op, err)
        if not err <= self.tolerance:
            self.mismatch(path, dc, req, "computed", f"{tensor_label(t)} within NMSE {self.tolerance:g}",
                          f"NMSE {err:.3g}")
