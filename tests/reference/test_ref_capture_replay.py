"""Real upstream 7.0.0 and 6.0.0 client traffic replayed against the reference server, command by command.

Server-assigned values (buffer handles, base addresses, tensor buffer/data) are relocated to the new server's
from its ALLOC_BUFFER and BUFFER_GET_BASE replies.  Every command must be accepted; reply values that do not
depend on the server's memory layout are compared with upstream's.  Compute results are the executor's concern:
the connection may end at a graph only if the executor refuses one of its ops (or is not installed).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from ggml_rpc.conformance.client import ConnectionClosed
from ggml_rpc.conformance.nmse import nmse
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.spans import as_buffer
from ggml_rpc.reference import running_server
from ggml_rpc.spec import Command
from refhelpers import connect

GRAPH_COMMANDS = (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)
# Replies that depend only on the protocol and the (CPU) backend, not on addresses or free memory.
COMPARED = {Command.DEVICE_COUNT, Command.GET_ALIGNMENT, Command.GET_MAX_SIZE, Command.SET_TENSOR_HASH,
            Command.COPY_TENSOR, Command.GET_ALLOC_SIZE}


class Relocator:
    """Old (captured) buffer handles and bases -> the new server's."""

    def __init__(self) -> None:
        self.handles: dict[int, int] = {}
        self.bases: dict[int, tuple[int, int]] = {}  # old handle -> (old base, new base)

    def tensor(self, t: dict) -> dict:
        old = t["buffer"]
        if old not in self.handles:
            return t
        old_base, new_base = self.bases[old]
        out = dict(t)
        out["buffer"] = self.handles[old]
        if t["data"]:
            out["data"] = t["data"] - old_base + new_base
        return out

    def fields(self, command: Command, f: dict) -> dict:
        f = dict(f)
        if "remote_ptr" in f:
            f["remote_ptr"] = self.handles.get(f["remote_ptr"], f["remote_ptr"])
        for key in ("tensor", "src", "dst", "op"):
            if key in f:
                f[key] = self.tensor(f[key])
        if "srcs" in f:
            f["srcs"] = [self.tensor(s) for s in f["srcs"]]
        if command is Command.GRAPH_COMPUTE:
            arr = f["tensors"].copy()
            for old, new in self.handles.items():
                mask = arr["buffer"] == old
                if mask.any():
                    old_base, new_base = self.bases[old]
                    arr["buffer"][mask] = new
                    nonzero = mask & (arr["data"] != 0)
                    arr["data"][nonzero] = arr["data"][nonzero] - np.uint64(old_base) + np.uint64(new_base)
            f["tensors"] = arr
        return f


@pytest.mark.parametrize(("name", "proto"), [("v7-v7-gen-cold.pcap", (7, 0, 0)), ("v6-v6-gen-cold.pcap", (6, 0, 0))])
def test_generation_session_is_accepted(real_captures, tmp_path, caplog, name, proto) -> None:
    conns = decode_file(real_captures / name)
    assert len(conns) == 11 and all(c.ok for c in conns)
    caplog.set_level(logging.INFO, logger="ggml_rpc.reference")
    sent = 0
    stopped_at = None
    nmse_values: list[float] = []
    with running_server(str(proto[0]), cache_dir=str(tmp_path)) as srv:
        for conn in conns:
            replies = {id(r.request): r for r in conn.replies}
            reloc = Relocator()
            with connect(srv) as c:
                assert c.server_version == proto
                for req in conn.requests[1:]:  # HELLO was sent by connect()
                    fields = reloc.fields(req.command, req.fields)
                    try:
                        reply = c.request(req.command, fields, as_buffer(req.data))
                        if reply is None:
                            assert c.device_count() == 1  # the no-reply command was accepted
                    except ConnectionClosed:
                        if req.command in GRAPH_COMMANDS:
                            stopped_at = req
                            break
                        raise AssertionError(f"server closed on {req.command.name} #{req.index}") from None
                    sent += 1
                    old = replies.get(id(req))
                    if reply is None:
                        continue
                    if req.command is Command.ALLOC_BUFFER:
                        assert reply.fields["remote_ptr"] != 0
                        assert reply.fields["remote_size"] == old.fields["remote_size"]
                        reloc.handles[old.fields["remote_ptr"]] = reply.fields["remote_ptr"]
                    elif req.command is Command.BUFFER_GET_BASE:
                        reloc.bases[req.fields["remote_ptr"]] = (old.fields["base_ptr"], reply.fields["base_ptr"])
                    elif req.command in COMPARED:
                        assert reply.fields == old.fields, req.command.name
                    elif req.command is Command.GET_TENSOR:
                        assert reply.data.nbytes == old.data.nbytes
                        if reply.data.nbytes % 4 == 0:
                            want, got = (np.frombuffer(d, np.float32) for d in (as_buffer(old.data), reply.data))
                            nmse_values.append(nmse(want, got))
            if stopped_at is not None:
                break
    if stopped_at is not None:
        closes = [r.getMessage() for r in caplog.records if "closed:" in r.getMessage()]
        assert closes and ("executor" in closes[-1]), closes
    else:
        assert sent == sum(len(c.requests) - 1 for c in conns)
        # output.weight (v7: the flagged upload; v6: the only payload > 10 MiB) is the only cache entry, named and
        # sized as upstream's.
        assert sorted(p.name for p in tmp_path.iterdir()) == ["446e2d6404939d1e"]
        assert (tmp_path / "446e2d6404939d1e").stat().st_size == 32_768_000
        # End to end through server and executor: every read-back (logits included) matches upstream's.
        assert len(nmse_values) == 17 and max(nmse_values) < 1e-6


@pytest.mark.parametrize("name", ["v7-v7-test-backend-ops.pcap"])
def test_backend_ops_session_commands_are_accepted(real_captures, name, caplog) -> None:
    conns = decode_file(real_captures / name)
    caplog.set_level(logging.INFO, logger="ggml_rpc.reference")
    with running_server("7") as srv:
        for conn in conns:
            reloc = Relocator()
            replies = {id(r.request): r for r in conn.replies}
            with connect(srv) as c:
                for req in conn.requests[1:]:
                    try:
                        reply = c.request(req.command, reloc.fields(req.command, req.fields),
                                            as_buffer(req.data))
                    except ConnectionClosed:
                        assert req.command in GRAPH_COMMANDS, req.command.name
                        closes = [r.getMessage() for r in caplog.records if "closed:" in r.getMessage()]
                        assert closes and "executor" in closes[-1], closes
                        break
                    old = replies.get(id(req))
                    if req.command is Command.ALLOC_BUFFER:
                        reloc.handles[old.fields["remote_ptr"]] = reply.fields["remote_ptr"]
                    elif req.command is Command.BUFFER_GET_BASE:
                        reloc.bases[req.fields["remote_ptr"]] = (old.fields["base_ptr"], reply.fields["base_ptr"])
