"""How a reference connection ends: the two exceptions its loop turns into a logged reason."""

from __future__ import annotations


class Close(Exception):
    """End this connection without a reply; the message names the rule and what upstream does."""


class PeerGone(Exception):
    """The client closed or reset the connection."""


def upstream(text: str) -> str:
    """The note a Close message ends with: what upstream does in the same case."""
    return f" (upstream: {text})"
