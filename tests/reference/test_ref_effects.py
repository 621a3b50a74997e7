"""The core never blocks: the hash cache's lookups, waits, reads and writes leave it as effects the caller carries
out (the core holds the cache only as an injected EntryCache); and every write into a buffer goes through its one
write path, which the executor's cached conversions are checked against."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.reference import ServerCore, make_config
from ggml_rpc.reference.devices import Buffer
from ggml_rpc.reference.effects import FindEntry, LoadEntry, SaveEntry
from ggml_rpc.spec import V7, V8, Command, GgmlOp, GgmlType, Protocol, TensorFlag, encode_request, fnv1a64, make_tensor

REFERENCE = Path(__file__).resolve().parents[2] / "reference"


class FakeCache:
    """An EntryCache that only counts: no directory, no file, no lock."""

    def __init__(self) -> None:
        self.begun = self.ended = 0

    def begin_save(self) -> None:
        self.begun += 1

    def end_save(self) -> None:
        self.ended += 1


def _core(protocol: Protocol = V7, cache: FakeCache | None = None, **options: object) -> ServerCore:
    core = ServerCore(make_config(protocol, **options), cache)  # type: ignore[arg-type]
    core.receive_data(encode_request(protocol, Command.HELLO, {"conn_caps": bytes(24)}))
    assert core.next_event()
    return core


def _run(core: ServerCore, protocol: Protocol, command: Command, fields: dict, data: bytes | None = None) -> bytes:
    core.receive_data(encode_request(protocol, command, fields, data))
    out = core.next_event()
    assert out is not None and core.effect is None
    return b"".join(bytes(p) for p in out)


def _tensor(core: ServerCore, protocol: Protocol, n: int, tid: int = 1) -> dict:
    reply = _run(core, protocol, Command.ALLOC_BUFFER, {"device": 0, "size": n})
    handle = int.from_bytes(reply[8:16], "little")
    buf = core.table.buffers[handle]
    return make_tensor(id=tid, ne=(n,), type=int(GgmlType.I8), buffer=handle, data=buf.base)


# ---- the cache's work as effects -----------------------------------------------------------------------------


def test_a_kept_set_tensor_asks_for_its_save_instead_of_writing() -> None:
    cache = FakeCache()
    core = _core(V7, cache)
    t = _tensor(core, V7, 64)
    data = bytes(range(64))
    core.receive_data(encode_request(V7, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 1}, data))
    assert core.next_event() is None  # the command waits on its effect, not on bytes
    effect = core.effect
    assert isinstance(effect, SaveEntry) and bytes(effect.data) == data
    assert np.shares_memory(np.frombuffer(effect.data, np.uint8), core.table.buffers[t["buffer"]].memory)
    assert (cache.begun, cache.ended) == (1, 0)  # announced, not over: a miss elsewhere waits for it
    assert core.next_event() is None and core.effect is effect  # nothing moves until it is carried out
    core.effect_done(None)
    assert core.next_event() == ()  # then SET_TENSOR's event, as without a cache
    assert (cache.begun, cache.ended) == (1, 1) and core.effect is None


def test_a_set_tensor_the_version_does_not_keep_asks_for_nothing() -> None:
    cache = FakeCache()
    core = _core(V7, cache)
    t = _tensor(core, V7, 64)
    _run(core, V7, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 0}, bytes(64))
    assert (cache.begun, cache.ended) == (0, 0)


def test_a_connection_that_ends_before_its_save_ends_the_save() -> None:
    cache = FakeCache()
    core = _core(V7, cache)
    t = _tensor(core, V7, 64)
    core.receive_data(encode_request(V7, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 1},
                                     bytes(64)))
    assert core.next_event() is None and isinstance(core.effect, SaveEntry)
    core.release()
    assert (cache.begun, cache.ended) == (1, 1) and core.effect is None


def test_set_tensor_hash_finds_then_loads_through_effects() -> None:
    cache = FakeCache()
    core = _core(V7, cache)
    t = _tensor(core, V7, 64)
    content = bytes(range(100, 132))
    digest = fnv1a64(content)
    request = encode_request(V7, Command.SET_TENSOR_HASH, {"tensor": t, "offset": 8, "hash": digest})

    core.receive_data(request)
    assert core.next_event() is None and core.effect == FindEntry(digest, 5.0)
    core.effect_done(None)  # no such entry, even after waiting for saves under way
    assert b"".join(core.next_event() or ())[8:] == b"\x00"  # a miss

    buf = core.table.buffers[t["buffer"]]
    epoch = buf.epoch
    core.receive_data(request)
    assert core.next_event() is None and isinstance(core.effect, FindEntry)
    core.effect_done(len(content))
    assert core.next_event() is None
    load = core.effect
    assert isinstance(load, LoadEntry) and load.digest == digest and load.region.nbytes == len(content)
    assert buf.epoch == epoch + 1  # marked written before the entry's bytes land
    load.region[:] = content  # what the I/O module does with a verified entry
    core.effect_done(True)
    assert b"".join(core.next_event() or ())[8:] == b"\x01"  # a hit
    assert bytes(buf.memory[8:40]) == content


def test_without_a_cache_set_tensor_hash_misses_at_once() -> None:
    core = _core(V7)
    t = _tensor(core, V7, 64)
    reply = _run(core, V7, Command.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": 1})
    assert reply[8:] == b"\x00"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_the_core_and_its_command_groups_hold_no_file_thread_or_clock() -> None:
    core_modules = ["core.py", "buffer_commands.py", "tensor_commands.py", "row_commands.py", "graph_commands.py",
                    "resolve.py", "replies.py", "closing.py", "effects.py", "devices.py"]
    for name in core_modules:
        found = _imports(REFERENCE / name) & {"os", "threading", "time", ".cache", "socket", "shutil", "tempfile"}
        assert not found, (name, found)


# ---- one write path ------------------------------------------------------------------------------------------


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The handles of the buffers every write marks, in order (Buffer.written, the one write path)."""
    seen: list[int] = []
    real = Buffer.written

    def written(self: Buffer) -> None:
        seen.append(self.handle)
        real(self)

    monkeypatch.setattr(Buffer, "written", written)
    return seen


def _graph_fields(t: dict, protocol: Protocol) -> dict:
    node = make_tensor(id=2, ne=(64,), type=t["type"], buffer=t["buffer"], data=t["data"], op=int(GgmlOp.ADD),
                       flags=int(TensorFlag.COMPUTE), src=[1, 1])
    fields = {"device": 0, "nodes": [2], "tensors": [t, node]}
    return {**fields, "uid": 1} if protocol is V8 else fields


@pytest.mark.parametrize("command", ["SET_TENSOR", "SET_TENSOR_2D", "MEMSET_TENSOR", "COPY_TENSOR", "BUFFER_CLEAR",
                                     "GRAPH_COMPUTE"])
def test_every_write_command_marks_its_buffer_written(command: str, writes: list[int]) -> None:
    protocol = V8 if command == "SET_TENSOR_2D" else V7
    # An executor that computes nothing: the write path is the server's, whatever the executor does.
    core = _core(protocol, executor=lambda nodes: None)
    t = _tensor(core, protocol, 64)
    other = _tensor(core, protocol, 64, tid=3)
    buf = core.table.buffers[t["buffer"]]
    epoch = buf.epoch
    writes.clear()
    fields: dict = {
        "SET_TENSOR": {"tensor": t, "offset": 0, "cache_flag": 0},
        "SET_TENSOR_2D": {"tensor": t, "offset": 0, "size": 4, "n_copies": 2, "stride": 8},
        "MEMSET_TENSOR": {"tensor": t, "offset": 0, "size": 8, "value": 7},
        "COPY_TENSOR": {"src": other, "dst": t},
        "BUFFER_CLEAR": {"remote_ptr": t["buffer"], "value": 1},
        "GRAPH_COMPUTE": _graph_fields(t, protocol),
    }[command]
    data = {"SET_TENSOR": bytes(16), "SET_TENSOR_2D": bytes(8)}.get(command)
    _run(core, protocol, Command[command], fields, data)
    assert writes == [t["buffer"]] and buf.epoch == epoch + 1


def test_reads_do_not_mark_a_buffer_written(writes: list[int]) -> None:
    core = _core(V7)
    t = _tensor(core, V7, 64)
    writes.clear()
    _run(core, V7, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 8})
    _run(core, V7, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 0}, b"")  # nothing written
    assert writes == []


def test_only_the_write_path_changes_a_write_epoch() -> None:
    changed = []
    for path in sorted(REFERENCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign) else []
            changed += [f"{path.relative_to(REFERENCE)}:{node.lineno}" for t in targets
                        if isinstance(t, ast.Attribute) and t.attr == "epoch"]
    assert changed == ["devices.py:" + str(_written_line())]


def _written_line() -> int:
    tree = ast.parse((REFERENCE / "devices.py").read_text(encoding="utf-8"))
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "written")
    return next(n.lineno for n in ast.walk(method) if isinstance(n, ast.AugAssign))
