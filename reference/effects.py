"""What a connection's core asks of the world and cannot do itself without blocking: the hash cache's work.

The core (:mod:`.core`) is sans-IO: it never waits and never touches a file.  The server's hash cache lives on disk
and is shared by every connection, so three things a command needs from it would block:

* :class:`FindEntry` -- SET_TENSOR_HASH: the size of the entry named after a hash, or None; a miss first waits, at
  most ``wait`` seconds, for saves under way on other connections (a client may upload on one connection and ask on
  the next of a ``--concurrent`` server);
* :class:`LoadEntry` -- a SET_TENSOR_HASH hit: the entry's verified bytes put into the tensor's region; True if they
  were (a miss otherwise);
* :class:`SaveEntry` -- a SET_TENSOR the version says the server keeps: its bytes, now in tensor memory, written as
  an entry (atomically, fsync'd), before the next command runs.

A command yields one of these and is resumed with its result; :meth:`.core.ServerCore.next_event` then returns None
with the effect in :attr:`.core.ServerCore.effect`, the I/O module (``server.py``; the fuzzer's oracle, which drives a
core itself) carries it out against its cache (:meth:`.cache.HashCache.carry_out`) and hands the result back with
:meth:`.core.ServerCore.effect_done`.

What the core does hold is :class:`EntryCache`, the bookkeeping that never blocks: it says when a save is announced
(the SET_TENSOR's header is in) and when it is over (saved, or the connection ended first), so that a miss on another
connection knows to wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class EntryCache(Protocol):
    """The hash cache as a connection's core holds it: the server's cache, injected (None: the server has none)."""

    def begin_save(self) -> None:
        """A save is announced (its data is on its way)."""

    def end_save(self) -> None:
        """An announced save is over, done or abandoned."""


@dataclass(frozen=True, slots=True)
class FindEntry:
    """The size of the entry named after ``digest`` (None: no entry), after waiting up to ``wait`` seconds for saves
    under way when there is none."""

    digest: int
    wait: float


@dataclass(frozen=True, slots=True)
class LoadEntry:
    """Fill ``region`` (tensor memory) with the verified content of the entry named after ``digest``; True if it
    was filled, False for a miss."""

    digest: int
    region: memoryview


@dataclass(frozen=True, slots=True)
class SaveEntry:
    """Keep ``data`` (tensor memory, which nothing writes until the next command) as an entry named after its hash."""

    data: memoryview


#: What a core may wait on besides bytes.
Effect = FindEntry | LoadEntry | SaveEntry
EFFECTS = (FindEntry, LoadEntry, SaveEntry)

__all__ = ["EFFECTS", "Effect", "EntryCache", "FindEntry", "LoadEntry", "SaveEntry"]
