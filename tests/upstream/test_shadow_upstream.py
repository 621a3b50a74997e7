"""What the shadow-memory oracle found on genuine 8.0.0, shown against the server itself.

8.0.0's deserialize_tensor does not check where a tensor of zero elements lies, and COPY_TENSOR checks only that the
copy ends before its destination buffer's end: a destination of zero elements anywhere below that end receives the
source's bytes. SHADOW-011 reports it (another buffer of the session changed); the reproducers of
``fixtures/repro/v8-copy-tensor-zero-elements-*.pcap`` kill the server with it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from ggml_rpc.conformance.checks import by_id
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.harness import ExternalTarget, Outcome, Runner
from ggml_rpc.conformance.upstream.peers import PEERS, Peer
from ggml_rpc.conformance.upstream.runs import UpstreamServer
from ggml_rpc.spec import V8, GgmlType, make_tensor

pytestmark = pytest.mark.upstream

PATTERN = bytes(range(0xA0, 0xB0))


def _peer(label: str) -> Peer:
    peer = PEERS[label]
    if not peer.installed():
        message = f"upstream {label} not installed: run `ggml-rpc upstream install --proto {peer.major}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return peer


def test_a_zero_element_copy_destination_writes_into_another_buffer_of_the_connection() -> None:
    with UpstreamServer(_peer("8.0.0"), cache=False) as server, \
            RpcClient.connect("127.0.0.1", server.port, timeout=10) as c:
        # Two buffers of one size; A is the one the allocator put lower (the order is the allocator's).
        x, _ = c.alloc_buffer(0, 4096)
        y, _ = c.alloc_buffer(0, 4096)
        (a_base, a), (b_base, b) = sorted((c.buffer_get_base(h), h) for h in (x, y))
        whole_a = make_tensor(id=1, type=int(GgmlType.I8), ne=(1024,), buffer=a, data=a_base)
        canary = np.random.default_rng(1).integers(1, 256, 1024, dtype=np.uint8).tobytes()
        c.set_tensor(whole_a, 0, canary)
        src = make_tensor(id=2, type=int(GgmlType.I8), ne=(16,), buffer=b, data=b_base)
        c.set_tensor(src, 0, PATTERN)
        # Zero elements, B's handle, an address inside A: [data, data + 0) is never checked against B.
        dst = make_tensor(id=3, type=int(GgmlType.F32), ne=(0, 1, 1, 1), buffer=b, data=a_base + 256)
        assert a_base + 256 + 16 <= b_base + 4096  # the copy's only check: it ends before B's end
        c.copy_tensor(src, dst)
        after = bytes(c.get_tensor(whole_a, 0, 1024))
    assert after[256:272] == PATTERN
    assert after[:256] == canary[:256] and after[272:] == canary[272:]


def test_shadow_011_reports_it() -> None:
    with UpstreamServer(_peer("8.0.0"), cache=False) as server:
        runner = Runner(ExternalTarget("127.0.0.1", server.port), expect=V8, timeout=5.0, probe_timeout=5.0)
        runner.start()
        try:
            result = runner.run_one(by_id("SHADOW-011"))
        finally:
            runner.stop()
    assert result.outcome is Outcome.FAIL, result.message
    # Bytes of another buffer changed, or the server died of what the copy wrote (a heap header below a buffer).
    assert "changed" in result.message or result.server_death, result.message
    assert result.evidence
