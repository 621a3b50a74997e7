"""SIGINT and SIGTERM, the same for every command: stop within 2 s, clean up, exit 130.

``timeout`` and service managers signal the whole process group, so a target the kit started in that group dies at
the same moment the kit is told to stop.  Two rules keep that from turning into a verdict: the first signal stops
the command (by default as a :class:`KeyboardInterrupt`, which every command's ``finally`` blocks turn into a clean
shutdown), and :func:`interrupted` tells the command's own code that what it sees from now on is the kit's own
termination, not a finding.

A command that must finish a step before stopping (the fuzzer closes its example) registers a ``soft`` stop with
:func:`soft_stop`: the first signal calls it instead of raising, and :data:`GRACE` seconds later, if the command
has not returned yet, a :class:`KeyboardInterrupt` is raised after all so the 2 s promise holds.  A second signal
always raises at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

#: The exit code of every command stopped by SIGINT or SIGTERM (the shell's 128 + SIGINT).
EXIT_INTERRUPTED = 130

#: Seconds a soft stop may take before the command is interrupted the hard way (under the promised 2 s).
GRACE = 1.2

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _State:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.soft: Callable[[], None] | None = None


_state = _State()


def interrupted() -> int | None:
    """The signal that stopped this command (SIGINT or SIGTERM), or None while it was not told to stop."""
    return _state.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _hard(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _handler(signum: int, frame: object) -> None:
    first = _state.signum is None
    if first:
        _state.signum = signum
    soft = _state.soft
    if first and soft is not None:
        # The grace timer runs in the main thread as SIGALRM, so it can raise where the command is.
        signal.signal(signal.SIGALRM, _hard)
        signal.setitimer(signal.ITIMER_REAL, GRACE)
        soft()
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Install the handlers for one command (main thread only: elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.signum = None
    _state.soft = None
    previous = {s: signal.signal(s, _handler) for s in _SIGNALS}
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        _state.soft = None


@contextlib.contextmanager
def soft_stop(stop: Callable[[], None]) -> Iterator[None]:
    """While inside, the first SIGINT/SIGTERM calls ``stop`` (which must make the command return soon)."""
    _state.soft = stop
    try:
        yield
    finally:
        _state.soft = None
        # A command that returned within its grace time needs no KeyboardInterrupt any more.
        if threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)


__all__ = ["EXIT_INTERRUPTED", "GRACE", "handling", "interrupted", "signal_name", "soft_stop"]
