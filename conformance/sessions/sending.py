"""The replayer's bulk I/O: requests whose data is still in the capture file sent a slice at a time, and large
replies received a slice at a time, so neither is ever whole in memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ggml_rpc.spec import Command, Protocol, request_parts
from ggml_rpc.spec.payloads import REQUEST_HEADER

from ..client import RpcClient
from .spans import LazyBytes

#: Bulk data is sent from the capture, and large replies read and compared, this many bytes at a time.
SLICE = 4 << 20


def send_request(client: RpcClient, target: Protocol, cmd: Command, fields: dict[str, Any],
                 data: memoryview | LazyBytes | None) -> int:
    """Send one request; bulk data still in the capture goes from the file a slice at a time.  Returns the bytes
    sent."""
    if not isinstance(data, LazyBytes):
        parts = request_parts(target, cmd, fields, data)
        client.send_raw(parts)
        return sum(memoryview(p).nbytes for p in parts)
    # The header and fixed fields as encoded without data, the size header then counting the data that follows.
    parts = request_parts(target, cmd, fields, None)
    size = sum(memoryview(p).nbytes for p in parts[1:]) + data.nbytes
    spec = target.spec(cmd)
    assert spec is not None
    parts[0] = REQUEST_HEADER.pack(target.wire_id(spec.command), size)
    client.send_raw(parts)
    for views in data.stream.windows(data.start, data.stop, SLICE):
        client.send_raw(views)
    return REQUEST_HEADER.size + size


def received(client: RpcClient, size: int) -> Iterator[memoryview]:
    """A reply body of ``size`` bytes read from the socket in slices of :data:`SLICE` (one buffer, reused: each
    slice is valid until the next is asked for).  Always reads the whole body, so the connection stays framed."""
    buf = memoryview(bytearray(min(size, SLICE)))
    left = size
    while left:
        n = min(left, SLICE)
        client._recv_into(buf[:n])
        left -= n
        yield buf[:n]
