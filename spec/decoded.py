"""A decoded message, as the codec's message mode hands it back: a whole :class:`Request` or :class:`Reply`.

Below both the codec (:mod:`.codec`, which builds them) and the table's stateless checks (:mod:`.checks`, which read
them), so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .enums import Command
from .payloads import REPLY_HEADER_SIZE, REQUEST_HEADER_SIZE


@dataclass(slots=True, eq=False)
class Request:
    """One decoded request."""

    command: Command
    fields: dict[str, Any]
    #: Bulk bytes: SET_TENSOR data, or trailing bytes after a GRAPH_COMPUTE; None otherwise.
    data: memoryview | None = None
    size: int = 0
    #: Byte offset of the command byte in the decoded stream.
    offset: int = 0
    index: int = 0
    raw: memoryview = field(default_factory=lambda: memoryview(b""))

    @property
    def wire_size(self) -> int:
        return REQUEST_HEADER_SIZE + self.size


@dataclass(slots=True, eq=False)
class Reply:
    """One decoded reply, paired with the request it answers."""

    command: Command
    fields: dict[str, Any]
    data: memoryview | None = None
    size: int = 0
    offset: int = 0
    index: int = 0
    request: Request | None = None
    raw: memoryview = field(default_factory=lambda: memoryview(b""))

    @property
    def wire_size(self) -> int:
        return REPLY_HEADER_SIZE + self.size


__all__ = ["Reply", "Request"]
