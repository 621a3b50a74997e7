"""The shadow-memory oracle's core on its own (``harness.shadow``): what it learns from the model after a write, what
it reads back, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from ggml_rpc.conformance.harness.shadow import EDGE, Ranges, Read, ShadowMemory, canary_bytes, runs
from ggml_rpc.spec import Command, GgmlOp, GgmlType, TensorFlag, make_tensor


@dataclass(eq=False)
class FakeBuffer:
    base: int
    size: int
    memory: np.ndarray = field(init=False)
    epoch: int = 0

    def __post_init__(self) -> None:
        self.memory = np.zeros(self.size, dtype=np.uint8)

    def write(self, offset: int, data: bytes) -> None:
        self.memory[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        self.epoch += 1


def test_ranges_merge_split_and_clip() -> None:
    r = Ranges([(0, 4), (8, 12)])
    r.add(4, 8)
    assert list(r) == [(0, 12)] and r.total == 12
    r.remove(2, 5)
    assert list(r) == [(0, 2), (5, 12)]
    assert r.clip(1, 7) == [(1, 2), (5, 7)]
    assert r.mask(0, 6).tolist() == [True, True, False, False, False, True]
    r.remove(0, 100)
    assert list(r) == [] and r.total == 0
    assert runs(np.array([False, True, True, False, True])) == [(1, 3), (4, 5)]


def _memory(*sizes: int, exact: bool = False) -> tuple[ShadowMemory, dict[int, FakeBuffer]]:
    buffers = {h + 1: FakeBuffer(0x1000_0000 * (h + 1), size) for h, size in enumerate(sizes)}
    mem = ShadowMemory(buffers, exact=exact)
    mem.sync()
    for handle, buf in buffers.items():
        buf.write(0, canary_bytes(buf.size, handle))
        mem.mark(handle, role=f"buffer {handle}")
    return mem, buffers


def test_a_fresh_buffer_is_unknown_until_written_and_an_exact_target_knows_it_whole() -> None:
    buffers = {1: FakeBuffer(0x1000, 64)}
    mem = ShadowMemory(buffers)
    mem.sync()
    assert mem.tracked[1].known.total == 0  # the model's zeros are not the target's fresh bytes
    buffers[1].write(8, b"\x01\x02")
    mem.after(Command.SET_TENSOR, {})
    assert list(mem.tracked[1].known) == [(8, 10)]
    exact = ShadowMemory({1: FakeBuffer(0x1000, 64)}, exact=True)
    exact.sync()
    assert exact.tracked[1].known.total == 64


def test_a_byte_changed_outside_the_write_is_a_corruption_named_by_buffer_and_offsets() -> None:
    mem, buffers = _memory(256, 256)
    buffers[1].write(0, b"\xaa" * 16)
    mem.after(Command.SET_TENSOR, {"tensor": make_tensor(id=1, type=int(GgmlType.I8), ne=(16,), buffer=1,
                                                              data=buffers[1].base)})
    assert mem.focus == [1]
    got = bytearray(buffers[2].memory.tobytes())
    got[0:3] = b"\xaa\xaa\xaa"  # what a server that wrote past the first buffer's tensor returns
    c = mem.judge(Read(2, 0, 256), got, destination=(1, 0, 16))
    assert c is not None and c.ranges == [(0, 3)] and c.where == "another buffer than the destination's"
    assert c.expected[:3] == buffers[2].memory[:3].tobytes() and c.got[:3] == b"\xaa\xaa\xaa"
    assert "buffer #2 (256 bytes, buffer 2)" in c.describe()
    assert mem.judge(Read(2, 0, 256), buffers[2].memory.tobytes()) is None


def test_graph_results_are_not_judged_against_another_server_and_copies_of_them_neither() -> None:
    mem, buffers = _memory(256)
    base = buffers[1].base
    src = make_tensor(id=1, type=int(GgmlType.F32), ne=(4,), buffer=1, data=base)
    node = make_tensor(id=2, type=int(GgmlType.F32), ne=(4,), buffer=1, data=base + 64, op=int(GgmlOp.SCALE),
                       flags=int(TensorFlag.COMPUTE))
    buffers[1].memory[64:80] = 7  # the model's result
    mem.after(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [2], "tensors": [src, node]})
    assert mem.tracked[1].known.clip(64, 80) == []  # another server's floats may differ in the last bits
    got = bytearray(buffers[1].memory.tobytes())
    got[64:80] = b"\x08" * 16
    assert mem.judge(Read(1, 0, 256), got) is None
    got[80] ^= 0xFF
    assert mem.judge(Read(1, 0, 256), got).ranges == [(80, 81)]
    # COPY_TENSOR of the result: the destination holds bytes the oracle does not know either.
    buffers[1].memory[128:144] = buffers[1].memory[64:80]
    buffers[1].epoch += 1
    dst = make_tensor(id=3, type=int(GgmlType.F32), ne=(4,), buffer=1, data=base + 128)
    mem.after(Command.COPY_TENSOR, {"src": node, "dst": dst})
    assert mem.tracked[1].known.clip(128, 144) == []
    mem.after(Command.GRAPH_RECOMPUTE, {"device": 0})  # the stored graph's spans again
    assert mem.tracked[1].known.clip(64, 80) == []


def test_the_reference_as_target_is_judged_on_graph_results_too() -> None:
    buffers = {1: FakeBuffer(0x1000, 128)}
    mem = ShadowMemory(buffers, exact=True)
    mem.sync()
    node = make_tensor(id=2, type=int(GgmlType.F32), ne=(4,), buffer=1, data=0x1000, flags=int(TensorFlag.COMPUTE))
    buffers[1].memory[0:16] = 3
    mem.after(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [2], "tensors": [node]})
    assert mem.tracked[1].known.total == 128


def test_reads_are_bounded_whole_for_small_buffers_sampled_at_the_edges_for_large_ones() -> None:
    mem, _ = _memory(512, 1 << 20, 256)
    mem.focus = [2]
    reads = mem.plan(order=[1, 2, 3], budget=4096, reads=4)
    assert sum(r.nbytes for r in reads) <= 4096 and len(reads) <= 4
    big = [r for r in reads if r.handle == 2]
    assert big and all(r.sampled for r in big)
    windows = [w for r in big for w in r.windows()]
    assert (0, EDGE) in windows and ((1 << 20) - EDGE, 1 << 20) in windows  # both edges of the large buffer
    assert [r for r in reads if r.handle in (1, 3) and not r.sampled]  # a neighbour, read whole
    two_d = [r for r in mem.plan(order=[1, 2, 3], budget=4096, two_d=True) if r.handle == 2]
    assert two_d[0].copies > 2 and two_d[0].stride > two_d[0].size
    assert mem.plan(readable=set()) == []  # nothing the target can be asked about
