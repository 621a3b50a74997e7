"""GET_ALLOC_SIZE of a buffer-less tensor whose strides claim more than 2^64 bytes wraps as upstream's size_t."""

from __future__ import annotations

from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.reference import CPU_ALIGNMENT, running_server
from ggml_rpc.spec import ggml_nbytes, make_tensor


def test_alloc_size_past_two_to_the_64_wraps_and_the_connection_stays_up():
    ne = (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 2)
    nb = (4, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    true_size = ggml_nbytes(0, ne, nb)
    assert true_size >= 1 << 64
    with running_server("7") as srv, RpcClient.connect(srv.host, srv.port) as client:
        tensor = make_tensor(id=1, type=0, ne=ne, nb=nb)
        assert client.get_alloc_size(0, tensor) == true_size % (1 << 64)
        assert client.get_alignment(0) == CPU_ALIGNMENT  # still served
