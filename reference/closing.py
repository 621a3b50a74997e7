"""How a reference command waits for bytes (:class:`Wait`, :class:`Bulk`), and how a connection ends: the two
exceptions its I/O loop turns into a logged reason."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable


class Wait:
    """What a command waits for (``want``: that many bytes, or a view to fill) and how the end of the stream there
    is reported (``eof``: the reason, given the bytes that did arrive)."""

    __slots__ = ("eof", "want")

    def __init__(self, want: int | memoryview, eof: Callable[[int], str]) -> None:
        self.want = want
        self.eof = eof


class Bulk:
    """Where a command's bulk data goes: ``views`` filled in order (tensor memory, never a copy of it; a list, or an
    iterable made as it is consumed), then ``done`` runs; ``cleanup`` runs in any case, also when the connection ends
    first."""

    __slots__ = ("cleanup", "done", "views")

    def __init__(self, views: Iterable[memoryview], done: Callable[[], None] | None = None,
                 cleanup: Callable[[], None] | None = None) -> None:
        self.views = views
        self.done = done
        self.cleanup = cleanup


def fill(bulk: Bulk) -> Generator[memoryview, None, None]:
    """A receiver (see :data:`.core.Receiver`) that fills ``bulk``'s views in turn, then finishes it."""
    try:
        yield from bulk.views  # each view is resumed with None once filled
        if bulk.done is not None:
            bulk.done()
    finally:
        if bulk.cleanup is not None:
            bulk.cleanup()


class Close(Exception):
    """End this connection without a reply; the message names the rule and what upstream does."""


class PeerGone(Exception):
    """The client closed or reset the connection."""


def upstream(text: str) -> str:
    """The note a Close message ends with: what upstream does in the same case."""
    return f" (upstream: {text})"
