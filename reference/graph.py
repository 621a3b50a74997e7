"""The graph the reference server rebuilds from GRAPH_COMPUTE and hands to the executor.

A :class:`GraphTensor` is one rpc_tensor with its references resolved (sources and view source are other
GraphTensors) and its memory located: ``buffer`` is the whole writable memory of the server buffer the tensor
lives in and ``offset`` is ``data - base`` inside it.  The server checks, before the executor ever sees a tensor,
that ``[offset, offset + nbytes)`` lies inside ``buffer``; the executor checks what each op needs beyond that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True, eq=False)
class GraphTensor:
    """One tensor of a rebuilt graph."""

    id: int
    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int
    #: The 16 raw i32 op parameters (read floats with ``op_params.view(np.float32)``).
    op_params: np.ndarray
    flags: int
    src: list[GraphTensor | None] = field(default_factory=lambda: [None] * 10)
    view_src: GraphTensor | None = None
    view_offs: int = 0
    #: Absolute address the client gave (0 when the tensor has no server memory).
    data: int = 0
    name: str = ""
    use_count: int = 0
    #: Whole memory of the tensor's server buffer (writable), or None for a tensor without a buffer.
    buffer: memoryview | None = None
    #: Byte offset of the tensor's first byte inside ``buffer``.
    offset: int = 0
    #: ggml_nbytes of the tensor as sent (already checked against the buffer).
    nbytes: int = 0


class ExecutorError(Exception):
    """A graph the executor refuses to run: unsupported op or type, or inputs that break the op's rules.

    The message names the op, the types and the shapes; the server closes the connection with it.
    """
