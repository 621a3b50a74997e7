"""The reference connection's two-dimensional transfers of 8.0.0: SET_TENSOR_2D and GET_TENSOR_2D, as a handler table
(:attr:`RowCommands.flat`, and the SET_TENSOR_2D runner) over the connection's resolver and reply queue.

A 2-D region is ``n_copies`` rows of ``size`` bytes, the first at ``tensor.data + offset``, each ``stride`` bytes
after the one before; on the wire the rows travel packed.  Both commands check the region the way upstream does
(non-zero counts, a span that fits 64 bits, the buffer and the tensor) before a single data byte is read or sent,
and SET_TENSOR_2D's payload must be exactly its header and ``size * n_copies`` bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ggml_rpc.spec import Command, Payload
from ggml_rpc.spec.codec import REPLY_HEADER
from ggml_rpc.spec.conditions import region_2d_span, region_past, rows_data_mismatch, rows_zero
from ggml_rpc.spec.layout import flat_layout

from .closing import SIZE_LIMIT, BulkDestination, Close, FlatHandler, Headed
from .closing import upstream as _upstream
from .devices import Buffer
from .replies import Replies
from .resolve import Resolver, Tensor


class RowCommands:
    """SET_TENSOR_2D and GET_TENSOR_2D over one connection's resolver and reply queue."""

    def __init__(self, resolve: Resolver, out: Replies) -> None:
        self.resolve = resolve
        self.out = out
        self.flat: dict[Command, FlatHandler] = {Command.GET_TENSOR_2D: self.get_tensor_2d_flat}

    def _rows(self, t: Tensor, offset: int, size: int, n_copies: int, stride: int,
              command: str) -> tuple[Buffer, int, int]:
        """Checks a 2-D region as upstream does; returns its buffer, the first row's offset in it and the span."""
        span = region_2d_span(size, n_copies, stride)
        if span is None:
            raise Close(f"{command}: size {size}, n_copies {n_copies}, stride {stride}: a count is 0 or the span "
                        f"overflows 64 bits{_upstream('close')}",
                        "ROWS-ZERO" if rows_zero(size, n_copies) else "ROWS-SPAN-OVERFLOW")
        if t.buffer is None:
            raise Close(f"{command}: tensor has no buffer (null or unknown handle){_upstream('close')}")
        buf = t.buffer
        if not buf.base <= t.data <= buf.end or offset > buf.end - t.data or span > buf.end - t.data - offset:
            raise Close(f"{command}: rows [{t.data:#x} + {offset}, +{span}) outside the buffer [{buf.base:#x}, "
                        f"+{buf.size}){_upstream('close')}")
        if region_past(offset, span, t.nbytes):
            raise Close(f"{command}: rows at offset {offset}, span {span}, outside the tensor's {t.nbytes} bytes"
                        f"{_upstream('close')}", "ROWS-PAST-TENSOR")
        return buf, t.data - buf.base + offset, span

    def set_tensor_2d_runner(self, payload: Payload) -> Headed:
        layout = flat_layout(payload.schema)
        slots = layout.slots()
        names = ("tensor", "offset", "size", "n_copies", "stride")
        tensor, offset, size, n_copies, stride = (slots[n][0] for n in names)
        head = layout.size

        def check(claim: int) -> None:
            if claim < head:
                raise Close(f"SET_TENSOR_2D size {claim} below its {head}-byte header{_upstream('close')}")
            if claim >= SIZE_LIMIT:
                raise Close(f"SET_TENSOR_2D size {claim} >= 2^63{_upstream('process abort, uncaught length error')}")

        def start(claim: int, data: Any, at: int) -> memoryview | BulkDestination:
            f = layout.struct.unpack_from(data, at)
            n, rows, row = claim - head, f[n_copies], f[size]
            zero = rows_zero(row, rows)
            if zero or rows_data_mismatch(row, rows, n):
                raise Close(f"SET_TENSOR_2D: {n} data bytes for n_copies {rows} x size {row}{_upstream('close')}",
                            "ROWS-ZERO" if zero else "ROWS-DATA-LENGTH")
            t = self.resolve.flat_tensor(f, tensor, "SET_TENSOR_2D")
            # Checked before a single data byte is taken: nothing is received that does not fit its rows.
            buf, first, _ = self._rows(t, f[offset], row, rows, f[stride], "SET_TENSOR_2D")
            step = f[stride]
            view = buf.write_view()
            if step == row:
                return view[first : first + n]
            # Rows land in order: with stride < size a later row overwrites, as upstream's.  One view at a time: the
            # count is a claim (stride 0 stacks any number of rows on one).
            return BulkDestination(view[first + i * step : first + i * step + row] for i in range(rows))

        return head, check, start

    def get_tensor_2d_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        t = self.resolve.flat_tensor(f, slots["tensor"][0], "GET_TENSOR_2D")
        size, n_copies, stride = (f[slots[n][0]] for n in ("size", "n_copies", "stride"))
        buf, start, span = self._rows(t, f[slots["offset"][0]], size, n_copies, stride, "GET_TENSOR_2D")
        head = REPLY_HEADER.pack(size * n_copies)
        if stride == size or n_copies == 1:
            self.out.send_data(head, buf.view()[start : start + size * n_copies])
            return
        window = buf.memory[start : start + span]
        rows = np.lib.stride_tricks.as_strided(window, shape=(n_copies, size), strides=(stride, 1), writeable=False)
        self.out.send_data(head, memoryview(np.ascontiguousarray(rows)).cast("B"))


__all__ = ["RowCommands"]
