"""The bug-class checks (FRAME-048..060) and the reference's refusals behind them.

A canary check passes when the server refuses its graph, so against the reference (which refuses every bad input)
it would pass even if its graphs were malformed and refused for another reason.  Here the same checks run with
in-range values: the reference must compute every graph and find its canaries intact, which proves the graphs are
well formed and the canary comparison sees a computed result.  The reference's own refusals of partial quantisation
blocks (#25288) and of ops carrying function pointers (#25289) are checked with the reason they log.
"""

from __future__ import annotations

import logging
import time

import pytest
from ggml_rpc.conformance.checks import bug_classes, by_id
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.harness import ExternalTarget, Outcome, Runner
from ggml_rpc.reference import Hooks, ServerCore, running_server
from ggml_rpc.spec import NATIVE_CALLBACK_OPS, V7, Command, GgmlOp, GgmlType, TensorFlag, encode_request, make_tensor

#: (check, module constant, in-range values a correct server computes)
VALID = [
    ("FRAME-055", "BAD_ROWS", ((7, 1), (0, 1))),
    ("FRAME-056", "BAD_ROWS", ((7, 1), (0, 1))),
    ("FRAME-057", "BAD_WINDOWS", ((16, 32, 0, (4, 2, 2)), (0, 256, 48, (4, 4)))),
    ("FRAME-058", "BAD_STATE_IDS", (0, 1)),
    ("FRAME-059", "BAD_SNAPSHOTS", (1,)),
]


def _run(check_id: str):
    with running_server(V7) as srv:
        runner = Runner(ExternalTarget(srv.host, srv.port), expect=V7, timeout=3.0, probe_timeout=2.0)
        runner.start()
        try:
            return runner.run_one(by_id(check_id))
        finally:
            runner.stop()


@pytest.mark.parametrize(("check_id", "name", "values"), VALID, ids=[v[0] for v in VALID])
def test_in_range_graphs_are_computed_with_canaries_intact(monkeypatch, check_id, name, values) -> None:
    monkeypatch.setattr(bug_classes, name, values)
    result = _run(check_id)
    assert result.outcome is Outcome.PASS, result.message
    parts = result.message.split("; ")
    assert len(parts) == len(values) * (2 if check_id == "FRAME-057" else 1), parts
    assert all(p.endswith("computed, canaries intact") for p in parts), parts


@pytest.mark.parametrize("check_id", ["FRAME-049", "FRAME-051", "FRAME-054"])
def test_graphs_the_reference_computes_are_judged_by_their_canaries(check_id) -> None:
    result = _run(check_id)
    assert result.outcome is Outcome.PASS, result.message
    assert "computed, canaries intact" in result.message and "refused" not in result.message


def test_the_empty_dimension_check_never_waits_for_its_timeout_on_a_correct_server() -> None:
    """FRAME-049 once waited for a ninth byte after the 8-byte empty reply, a whole timeout per case; against the
    reference (which answers at once) the check must end well within one timeout."""
    timeout = 20.0
    with running_server(V7) as srv:
        runner = Runner(ExternalTarget(srv.host, srv.port), expect=V7, timeout=timeout, probe_timeout=timeout)
        runner.start()
        try:
            started = time.monotonic()
            result = runner.run_one(by_id("FRAME-049"))
            took = time.monotonic() - started
        finally:
            runner.stop()
    assert result.outcome is Outcome.PASS, result.message
    assert took < timeout, f"FRAME-049 took {took:.1f} s with a {timeout:.0f} s timeout"


def test_the_empty_dimension_check_fails_bytes_after_the_empty_reply() -> None:
    """The probe behind the GET_TENSOR still catches a server that sends more than the empty reply."""

    def padded(core: ServerCore, fields: dict) -> None:
        core.handlers[Command.GET_TENSOR](fields)
        if fields["size"] == 0:
            core.send([b"\0"])  # a stray byte after the empty reply

    with running_server(V7, hooks=Hooks(handlers={Command.GET_TENSOR: padded})) as srv:
        runner = Runner(ExternalTarget(srv.host, srv.port), expect=V7, timeout=3.0, probe_timeout=2.0)
        runner.start()
        try:
            result = runner.run_one(by_id("FRAME-049"))
        finally:
            runner.stop()
    assert result.outcome is Outcome.FAIL and "the reply is not empty" in result.message, result.message


def test_the_overflowing_shape_wraps_to_16_bytes() -> None:
    ne, nb = bug_classes.overflowing_shape()
    exact = 1 + sum((n - 1) * s for n, s in zip(ne, nb, strict=True))
    assert exact == (1 << 64) + 16 and exact % (1 << 64) == 16
    assert all(0 < n < 1 << 32 for n in ne) and all(0 < s < 1 << 32 for s in nb)


def _closed_with(client: RpcClient, sent: bytes) -> bool:
    client.send_raw(sent)
    return client.expect_closed(timeout=3.0)


def _graph(buf_handle: int, base: int, op: int, params: list[int], src_type: int = int(GgmlType.F32),
           ne0: int = 4) -> bytes:
    a = make_tensor(id=1, type=src_type, ne=(ne0,), buffer=buf_handle, data=base)
    out = make_tensor(id=2, type=int(GgmlType.F32), ne=(ne0,), buffer=buf_handle, data=base + 256, op=op,
                      op_params=params, flags=int(TensorFlag.COMPUTE), src=[1] + [0] * 9)
    return encode_request(V7, Command.GRAPH_COMPUTE, {"device": 0, "nodes": [2], "tensors": [a, out]})


@pytest.mark.parametrize("op", sorted(NATIVE_CALLBACK_OPS), ids=lambda o: GgmlOp(o).name)
def test_the_reference_refuses_ops_carrying_a_function_pointer_and_logs_why(caplog, op) -> None:
    caplog.set_level(logging.INFO, logger="ggml_rpc.reference")
    pointer = bug_classes.FAULTING_POINTER
    params = [pointer & 0x7FFF_FFFF, (pointer >> 32) & 0x7FFF_FFFF, 1, 0]
    with running_server(V7) as srv, RpcClient.connect(srv.host, srv.port, protocol=V7) as c:
        handle, _ = c.alloc_buffer(0, 1024)
        assert _closed_with(c, _graph(handle, c.buffer_get_base(handle), op, params))
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "native function pointers: never executed" in logged, logged


def test_the_reference_refuses_a_partial_quantisation_block_and_logs_why(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ggml_rpc.reference")
    q4_0 = int(GgmlType.Q4_0)
    with running_server(V7) as srv:
        # SET_TENSOR of a Q4_0 tensor with ne[0] = 33 (18 bytes: one block and a partial one)
        with RpcClient.connect(srv.host, srv.port, protocol=V7) as c:
            handle, _ = c.alloc_buffer(0, 1024)
            t = make_tensor(id=1, type=q4_0, ne=(33,), nb=(18, 18, 18, 18), buffer=handle,
                            data=c.buffer_get_base(handle))
            sent = encode_request(V7, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 0}, bytes(16))
            assert _closed_with(c, sent)
        # the same tensor as a dequantising graph's source
        with RpcClient.connect(srv.host, srv.port, protocol=V7) as c:
            handle, _ = c.alloc_buffer(0, 1024)
            assert _closed_with(c, _graph(handle, c.buffer_get_base(handle), int(GgmlOp.CPY), [], q4_0, 33))
        # whole blocks are still fine
        with RpcClient.connect(srv.host, srv.port, protocol=V7) as c:
            handle, _ = c.alloc_buffer(0, 1024)
            t = make_tensor(id=1, type=q4_0, ne=(64,), buffer=handle, data=c.buffer_get_base(handle))
            c.set_tensor(t, 0, bytes(36))
            assert bytes(c.get_tensor(t, 0, 36)) == bytes(36)
    logged = [r.getMessage() for r in caplog.records if "block size" in r.getMessage()]
    assert len(logged) == 2 and all("ne[0] = 33 is not a multiple of q4_0's block size 32" in m.lower()
                                    for m in logged), logged
