"""What PROTOCOL.md says genuine servers do, beyond the byte layouts, checked against them.

``#compute``: a server hands each node's ``use_count`` to its CPU backend, which fuses an RMS_NORM with the MUL
that follows it when the norm's count is 1, and then never writes the norm's own tensor (with 0 or 2 it does).
``#alignment``: GET_ALIGNMENT answers 32.  (That a node without the COMPUTE flag is skipped is shown by the C client
of ``tests/interop_c``.)
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.upstream.peers import DEBIAN_BUILDS, PEERS, Peer, debian_peer
from ggml_rpc.conformance.upstream.runs import UpstreamServer
from ggml_rpc.spec import GgmlOp, TensorFlag, make_tensor

pytestmark = pytest.mark.upstream

_SENTINEL = -7.0
_COMPUTE = int(TensorFlag.COMPUTE)


def _peer(peer: Peer) -> Peer:
    if not peer.installed():
        source = " --from debian" if peer.origin == "debian" else ""
        message = f"upstream {peer.label} not installed: run `ggml-rpc upstream install --proto {peer.major}{source}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return peer


def _norm_written(client: RpcClient, use_count: int) -> tuple[bool, np.ndarray]:
    """Compute MUL(RMS_NORM(x), w) with the norm's use_count as given: was the norm's tensor written, and the MUL."""
    handle, _ = client.alloc_buffer(0, 4096)
    base = client.buffer_get_base(handle)
    ne = (8, 2)
    eps = struct.unpack("<i", struct.pack("<f", 1e-6))[0]
    x = make_tensor(id=1, ne=ne, buffer=handle, data=base)
    w = make_tensor(id=2, ne=ne, buffer=handle, data=base + 256)
    norm = make_tensor(id=3, ne=ne, buffer=handle, data=base + 512, op=int(GgmlOp.RMS_NORM), op_params=[eps],
                       flags=_COMPUTE, src=[1], use_count=use_count)
    mul = make_tensor(id=4, ne=ne, buffer=handle, data=base + 768, op=int(GgmlOp.MUL), flags=_COMPUTE, src=[3, 2])
    client.set_tensor(x, 0, np.arange(1, 17, dtype=np.float32).tobytes())
    client.set_tensor(w, 0, np.full(16, 2, dtype=np.float32).tobytes())
    client.set_tensor(norm, 0, np.full(16, _SENTINEL, dtype=np.float32).tobytes())
    client.graph_compute(0, [3, 4], [x, w, norm, mul])
    got = np.frombuffer(bytes(client.get_tensor(norm, 0, 64)), dtype=np.float32)
    product = np.frombuffer(bytes(client.get_tensor(mul, 0, 64)), dtype=np.float32)
    client.free_buffer(handle)
    return not bool((got == _SENTINEL).all()), product


@pytest.mark.parametrize("peer", [*PEERS.values(), *map(debian_peer, DEBIAN_BUILDS)], ids=lambda p: p.label)
def test_use_count_one_fuses_rms_norm_and_mul(peer: Peer) -> None:
    with UpstreamServer(_peer(peer), cache=False) as server:
        host, port = server.address.rsplit(":", 1)
        with RpcClient.connect(host, int(port)) as client:
            assert client.get_alignment(0) == 32
            results = {use: _norm_written(client, use) for use in (0, 1, 2)}
    assert {use: written for use, (written, _) in results.items()} == {0: True, 1: False, 2: True}
    # Fused or not, the MUL is the same.
    assert np.array_equal(results[0][1], results[1][1]) and np.array_equal(results[1][1], results[2][1])
