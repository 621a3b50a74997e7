"""Which covered version's SET_TENSOR layout a payload fits, from its first bytes and its length alone.

The framing rules of :mod:`.rules` use it to tell a SET_TENSOR sent in another version's layout (v6 bytes on a v7
connection or the reverse: the cache_flag byte present or missing) from one that merely runs past its tensor.
"""

from __future__ import annotations

from .enums import TYPES, Command
from .facts import ggml_nbytes
from .layout import flat_layout
from .versions import PROTOCOLS, Protocol


def _nbytes(t: dict) -> int | None:
    info = TYPES.get(int(t["type"]))
    return None if info is None or info.removed else ggml_nbytes(t["type"], t["ne"], t["nb"])


def _fit(protocol: Protocol, head: memoryview, size: int) -> int | None:
    """How far a SET_TENSOR of ``size`` payload bytes, read in ``protocol``'s layout, ends before its tensor's end
    (negative: past it; None: unreadable).  ``head`` holds at least the layout's header."""
    req = protocol.commands[Command.SET_TENSOR].request
    if size < req.header_size or head.nbytes < req.header_size:
        return None
    layout = flat_layout(req.schema)
    fields = layout.unpack(head[: layout.size])
    nbytes = _nbytes(fields["tensor"])
    return None if nbytes is None else nbytes - (fields["offset"] + size - layout.size)


def _others(protocol: Protocol) -> list[Protocol]:
    mine = protocol.commands[Command.SET_TENSOR].request.schema
    return [p for p in PROTOCOLS if p.commands[Command.SET_TENSOR].request.schema is not mine]


def other_framing(protocol: Protocol, head: memoryview, size: int | None = None) -> Protocol | None:
    """The covered version whose SET_TENSOR layout fits this payload when ``protocol``'s does not; ``size`` is the
    whole payload's length (default: ``head``'s), so bulk data need not be at hand."""
    size = head.nbytes if size is None else size
    for other in _others(protocol):
        fit = _fit(other, head, size)
        if fit is not None and fit >= 0:
            return other
    return None


def shifted_framing(protocol: Protocol, head: memoryview, size: int | None = None) -> Protocol | None:
    """A SET_TENSOR that fits ``protocol``'s layout only one byte short of its tensor's end while another version's
    layout fills the tensor exactly: the silent mis-framing (a v6 payload whose first data byte is 0 read as v7)."""
    size = head.nbytes if size is None else size
    if _fit(protocol, head, size) != 1:
        return None
    for other in _others(protocol):
        if _fit(other, head, size) == 0:
            return other
    return None


__all__ = ["other_framing", "shifted_framing"]
