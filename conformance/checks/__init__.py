"""The conformance catalogue: every check, as data, in run order.

``CATALOGUE`` is what ``ggml-rpc check --list`` prints; ``by_id`` finds one check.  The checks live in one module
per category; importing them registers them in the order below.
"""

from __future__ import annotations

from ..harness import Category, Check
from . import cache, compute, data, framing, handshake, isolation
from ._support import REGISTRY

_ORDER = {cat: i for i, cat in enumerate(Category)}
#: Every check, grouped by category (in :class:`Category` order), in definition order within a group.
CATALOGUE: tuple[Check, ...] = tuple(sorted(REGISTRY, key=lambda c: _ORDER[c.category]))
_BY_ID = {c.id: c for c in CATALOGUE}


def by_id(check_id: str) -> Check:
    """The check with this ID (KeyError if none)."""
    return _BY_ID[check_id]


__all__ = ["CATALOGUE", "by_id"]
