"""How a reference command waits for bytes, and how a connection ends: the two exceptions its I/O loop turns into a
logged reason."""

from __future__ import annotations

from collections.abc import Callable


class Wait:
    """What a command waits for (``want``: that many bytes, or a view to fill) and how the end of the stream there
    is reported (``eof``: the reason, given the bytes that did arrive)."""

    __slots__ = ("eof", "want")

    def __init__(self, want: int | memoryview, eof: Callable[[int], str]) -> None:
        self.want = want
        self.eof = eof


class Close(Exception):
    """End this connection without a reply; the message names the rule and what upstream does."""


class PeerGone(Exception):
    """The client closed or reset the connection."""


def upstream(text: str) -> str:
    """The note a Close message ends with: what upstream does in the same case."""
    return f" (upstream: {text})"
