"""How a reference command waits (for bytes: :class:`Wait`, :class:`BulkDestination`; for the cache: an effect of
:mod:`.effects`), and how a connection ends: the two exceptions its I/O loop turns into a logged reason."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any

from .effects import Effect

#: A claimed size from here on is a length error upstream does not catch (process abort): refused before anything.
SIZE_LIMIT = 1 << 63


class Wait:
    """What a command waits for (``want``: that many bytes, or a view to fill) and how the end of the stream there
    is reported (``eof``: the reason, given the bytes that did arrive)."""

    __slots__ = ("eof", "want")

    def __init__(self, want: int | memoryview, eof: Callable[[int], str]) -> None:
        self.want = want
        self.eof = eof


class BulkDestination:
    """Where a command's bulk data goes: ``views`` filled in order (tensor memory, never a copy of it; a list, or an
    iterable made as it is consumed), then the effect ``then`` is waited on (the I/O module carries it out);
    ``cleanup`` runs in any case, also when the connection ends first."""

    __slots__ = ("cleanup", "then", "views")

    def __init__(self, views: Iterable[memoryview], then: Effect | None = None,
                 cleanup: Callable[[], None] | None = None) -> None:
        self.views = views
        self.then = then
        self.cleanup = cleanup


#: A command that needs more than its request's bytes: a generator that yields what it waits for (an int: that many
#: bytes, sent back as ``bytes``; a memoryview: fill it; a :class:`Wait`; an effect of :mod:`.effects`, sent back
#: its result) and returns when the command is done.
Receiver = Generator[int | memoryview | Wait | Effect, Any, None]


#: A command with a fixed head before its bulk data: (head size, size checks, from the claimed size and the head
#: (a buffer and its offset there) to where the data goes: one view, a :class:`BulkDestination`, or None for no
#: data).
Headed = tuple[int, Callable[[int], None], Callable[[int, Any, int], "memoryview | BulkDestination | None"]]
#: A handler of a fixed-size command that reads the flat tuple of its request's derived layout, with the layout's
#: slots (field name -> (first position, width)); it returns a :data:`Receiver` when it must wait on an effect.
FlatHandler = Callable[[tuple, dict[str, tuple[int, int]]], "Receiver | None"]


def fill(bulk: BulkDestination) -> Receiver:
    """A receiver that fills ``bulk``'s views in turn, then waits on its effect."""
    try:
        yield from bulk.views  # each view is resumed with None once filled
        if bulk.then is not None:
            yield bulk.then
    finally:
        if bulk.cleanup is not None:
            bulk.cleanup()


class Close(Exception):
    """End this connection without a reply; the message names the rule and what upstream does.

    ``rule``: the id of the rule table's rule (``spec.rules``) the request broke, when the refusal is one of the
    table's (decided by that rule's condition, :mod:`ggml_rpc.spec.conditions`); None for refusals that need the
    server's state (buffers, devices, stored graphs) or the framing."""

    def __init__(self, message: str, rule: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule


#: The rule table's rules the reference refuses by the rule's own condition (the id a :class:`Close` carries).  Not
#: among them: COPY-FITS-DST (upstream bounds a copy by the destination's buffer, and so does the reference),
#: GRAPH-NO-NODES (upstream computes an empty graph), and the CACHE-FLAG-* and FRAMING-* rules, which bind the client
#: in ways one request does not show a server.
REFUSED_RULES = frozenset({"TENSOR-TYPE", "TENSOR-REMOVED-TYPE", "REGION-PAST-TENSOR", "ROWS-ZERO",
                           "ROWS-DATA-LENGTH", "ROWS-SPAN-OVERFLOW", "ROWS-PAST-TENSOR", "GRAPH-NULL-NODE",
                           "GRAPH-NODE-UNKNOWN"})


class PeerGone(Exception):
    """The client closed or reset the connection."""


def upstream(text: str) -> str:
    """The note a Close message ends with: what upstream does in the same case."""
    return f" (upstream: {text})"
