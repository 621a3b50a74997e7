"""Where a damaged capture ends inside a message.

A capture file cut short (``head -c``, a full disk, a killed tcpdump) or stopped while a connection was still open
ends its streams where the capture stopped, not where a peer stopped sending (``HalfConnection.cut``).  A
request or reply cut there is neither a spec violation nor something a server can be compared against: decode,
lint and replay each name the place (connection, direction, message index, byte offsets) and exit 1, and replay
stops that connection there instead of expecting the recorded server's "close".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ggml_rpc.spec import Direction
from ggml_rpc.spec.framing import ReplyFramer, RequestFramer

#: The id ``ggml-rpc lint`` reports a cut capture under.  Not a row of the protocol's rule table
#: (:mod:`ggml_rpc.spec.rules`): no peer broke anything, the recording is incomplete.
CAPTURE_TRUNCATED = "CAPTURE-TRUNCATED"
RULE_TEXT = "the capture holds every message whole (it does not end inside a request, or before a due reply)"


@dataclass(frozen=True)
class CaptureCut:
    """The message a capture ends inside (or before, for a reply that was due)."""

    connection: int
    direction: Direction
    #: The request's index (a reply is located by its request's index, as decode prints it).
    index: int
    #: The request's command (a reply's: its request's), None when the capture ends inside the request's header.
    command: str | None
    #: Stream offset of the message's first byte.
    start: int
    #: Stream offset where the capture ends (bytes of the direction captured).
    end: int
    #: The message's length on the wire (header included) as its header claims, None when the header is cut.
    size: int | None

    def detail(self) -> str:
        """Where, without the connection and direction (a lint violation names those itself)."""
        if not self.command:
            what = "message"
        else:
            what = f"{self.command} reply" if self.direction is Direction.S2C else self.command
        got = self.end - self.start
        of = f" of its {self.size}" if self.size is not None else ""
        return (f"the capture ends inside message {self.index} ({what}) at stream byte {self.end}: {got}{of} "
                f"byte(s) captured from byte {self.start}")

    def line(self) -> str:
        return f"connection {self.connection} ({self.direction}): {self.detail()}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_cut(connection: int, framer: RequestFramer, index: int, end: int) -> CaptureCut:
    """The request ``framer`` was inside when its stream (``end`` bytes) stopped; ``index``: requests framed before
    it (the index it gets when its header is cut)."""
    head = framer.unfinished
    if head is None:  # inside the 9-byte header: nothing but where it starts is known
        return CaptureCut(connection, Direction.C2S, index, None, framer.offset, end, None)
    return CaptureCut(connection, Direction.C2S, head.index, head.command.name, head.offset, end,
                      framer.header_size + head.size)


def reply_cut(connection: int, framer: ReplyFramer, end: int) -> CaptureCut | None:
    """The reply that was due (or arriving) when the server's stream (``end`` bytes) stopped; None when none was."""
    head = framer.unfinished
    request = head.request if head is not None else framer.next_request
    if request is None:
        return None
    start = head.offset if head is not None else framer.offset
    size = framer.header_size + head.size if head is not None else None
    return CaptureCut(connection, Direction.S2C, request.index, request.command.name, start, end, size)


__all__ = ["CAPTURE_TRUNCATED", "RULE_TEXT", "CaptureCut", "reply_cut", "request_cut"]
