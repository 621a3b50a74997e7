"""The conformance catalogue: every check, as data, in run order.

``CATALOGUE`` is what ``ggml-rpc check --list`` prints; ``by_id`` finds one check.  The checks live in one module
per category and register themselves when imported.  Imports are absolute so that a test runner importing this
folder under another name (pytest's rootdir-based names) still shares one registry.

Adding a check: write a function taking a :class:`~ggml_rpc.conformance.harness.Context` in the module of its
category and declare it with ``@check("ID", "title", Category.X, section=..., majors=..., level=..., rules=...)``
(from ``_support``; ``rules``: the ids of the rule table's rules it enforces, :mod:`ggml_rpc.spec.rules`); it passes
by returning (optionally a note), fails by raising ``fail(...)`` with evidence, skips with ``Skipped`` and declines
with ``Unsupported``.  Then give it a breaker in ``tests/conformance/breakers.py`` (a server broken in exactly what
the check judges): the test suite refuses a check that cannot fail, and one whose requests or whose breaker's replies
break a rule of the table it does not name.
"""

from __future__ import annotations

import ggml_rpc.conformance.checks.bug_classes
import ggml_rpc.conformance.checks.cache
import ggml_rpc.conformance.checks.comm
import ggml_rpc.conformance.checks.compute
import ggml_rpc.conformance.checks.data
import ggml_rpc.conformance.checks.deaths
import ggml_rpc.conformance.checks.framing
import ggml_rpc.conformance.checks.graph_cache
import ggml_rpc.conformance.checks.handshake
import ggml_rpc.conformance.checks.isolation
import ggml_rpc.conformance.checks.rows
import ggml_rpc.conformance.checks.shadow
from ggml_rpc.conformance.checks._support import REGISTRY
from ggml_rpc.conformance.harness import Category, Check

_ORDER = {cat: i for i, cat in enumerate(Category)}
#: Every check, grouped by category (in :class:`Category` order), by ID within a group.
CATALOGUE: tuple[Check, ...] = tuple(sorted(REGISTRY, key=lambda c: (_ORDER[c.category], c.id)))
_BY_ID = {c.id: c for c in CATALOGUE}


def by_id(check_id: str) -> Check:
    """The check with this ID (KeyError if none)."""
    return _BY_ID[check_id]


__all__ = ["CATALOGUE", "by_id"]
