"""Checks as data, and their verdicts.

A :class:`Check` is a declaration (ID, title, spec anchor, versions, level, category) plus a function taking a
:class:`~.context.Context`.  The function returns normally for a pass (optionally with a note) or raises
:class:`~.context.CheckFailed` (with evidence: what was sent, what was expected, what came back),
:class:`~.context.Skipped` (why the check cannot judge this server) or :class:`~.context.Unsupported` (the server
declines a feature the check needs).  A :class:`Result` is a check's verdict with its evidence.  A check's level is
the spec's :class:`~ggml_rpc.spec.rules.Level` (MUST or SHOULD), the same word as the rule table's.
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ggml_rpc.spec import PROTOCOLS, Command, Protocol
from ggml_rpc.spec.render.markdown import command_anchor
from ggml_rpc.spec.rules import Level

from .context import Context, Evidence

#: Where the generated protocol reference lives, relative to a checkout; check links point into it.
SPEC_DOC = "spec/PROTOCOL.md"


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    UNSUPPORTED = "unsupported"
    NOT_RUN = "not run"
    #: The check itself broke (a bug in the kit, not a finding about the server): counts as a failure.
    ERROR = "error"
    #: The server refused the harness's own setup (e.g. the buffer a check writes into), so the rule under test
    #: never ran: neither a pass nor a failure of that rule (see :class:`Blocked`).
    BLOCKED = "blocked"


class Category(enum.Enum):
    """Check groups, in the order a run goes through them."""

    HANDSHAKE = "handshake"
    FRAMING = "framing"
    DATA = "data"
    CACHE_V6 = "cache-v6"
    CACHE_V7 = "cache-v7"
    ISOLATION = "isolation"
    COMPUTE = "compute"
    COMM = "comm"


@dataclass(frozen=True, slots=True)
class Check:
    """One conformance check, as data."""

    id: str
    title: str
    category: Category
    level: Level
    #: Protocol majors the check applies to (e.g. ``(6, 7)``); ``(7,)`` for v7-only checks.
    majors: tuple[int, ...]
    #: What it enforces: a command (linked per version, ``v7-get_tensor``) or a fixed anchor (``framing``).
    section: Command | str
    func: Callable[[Context], str | None]
    #: Minimum (major, minor, patch) within the majors, for checks added by a patch release.
    min_version: tuple[int, int, int] | None = None
    #: Maximum version (inclusive) the check applies to, for behaviour a later patch changed.
    max_version: tuple[int, int, int] | None = None
    #: Runs even when the server's version is not covered (handshake checks).
    any_version: bool = False
    #: The ids of the rule table's rules (:data:`ggml_rpc.spec.rules.RULES`) the check enforces: those its requests
    #: break for the server to refuse, and those the server's replies must keep; none for a check of something the
    #: table does not state (a computed result, the server's own state).
    rules: tuple[str, ...] = ()
    #: The check sends what the spec does not allow (malformed framing, unknown or foreign handles, a second
    #: HELLO...) to see the server refuse it: the inputs that take a fragile server down.  False: every request it
    #: sends is valid, the reference answers it without closing (tests/conformance/test_check_profiles.py).
    bad_input: bool = False

    def applies_to(self, version: tuple[int, int, int]) -> bool:
        if version[0] not in self.majors:
            return False
        if self.min_version is not None and version < self.min_version:
            return False
        return self.max_version is None or version <= self.max_version

    def spec_link(self, protocol: Protocol | None) -> str:
        """``spec/PROTOCOL.md#<anchor>`` for the version the server speaks (its newest applicable otherwise)."""
        if isinstance(self.section, str):
            return f"{SPEC_DOC}#{self.section}"
        candidates = [p for p in PROTOCOLS if self.applies_to(p.version) and p.spec(self.section) is not None]
        chosen = protocol if protocol is not None and protocol in candidates else (candidates or [None])[-1]
        if chosen is None:
            return f"{SPEC_DOC}#enum-commands"
        return f"{SPEC_DOC}#{command_anchor(chosen, self.section)}"

    @property
    def versions_label(self) -> str:
        text = "/".join(str(m) for m in self.majors)
        if self.min_version:
            text = ">=" + ".".join(map(str, self.min_version))
        if self.max_version:
            text += " <=" + ".".join(map(str, self.max_version))
        return "any" if self.any_version else text


@dataclass(slots=True)
class Result:
    check: Check
    outcome: Outcome
    message: str = ""
    evidence: list[Evidence] = field(default_factory=list)
    #: For FAIL/ERROR: the level of the broken rule (MUST, or SHOULD for a check's SHOULD part).
    failed_level: Level | None = None
    duration: float = 0.0
    #: When the server died during this check: exit status and last log lines (spawned servers) or a note,
    #: plus the step during which it died and the bytes that step sent (``step``, ``sent``; None if unknown).
    server_death: dict[str, Any] | None = None
    spec: str = ""
    #: The failure came from the connection breaking (closed, reset, refused, timed out), not from a wrong answer:
    #: when the server turns out to have died, the death is the verdict.
    interrupted: bool = False
    #: The bytes of the check's connections (a :class:`~.exchange.Recorder`), for its pcap and HTML page.
    recording: Any = field(default=None, repr=False, compare=False)
    #: Where ``--pcap-dir`` wrote the exchange and ``--html`` the check's page (paths as given), or None.
    pcap: str | None = None
    html: str | None = None

    @property
    def failed(self) -> bool:
        return self.outcome in (Outcome.FAIL, Outcome.ERROR)

    def as_dict(self) -> dict[str, Any]:
        c = self.check
        return {
            "id": c.id,
            "title": c.title,
            "category": c.category.value,
            "level": c.level.value,
            "versions": c.versions_label,
            "spec": self.spec,
            "outcome": self.outcome.value,
            "failed_level": self.failed_level.value if self.failed_level else None,
            "message": self.message,
            "duration_s": round(self.duration, 4),
            "evidence": [e.as_dict() for e in self.evidence],
            "server_death": self.server_death,
            "pcap": self.pcap,
            "html": self.html,
        }


def select(checks: Sequence[Check], patterns: str | None) -> list[Check]:
    """Checks whose ID or category matches one of the comma-separated shell patterns (case-insensitive)."""
    if not patterns:
        return list(checks)
    pats = [p.strip().upper() for p in patterns.split(",") if p.strip()]
    out = []
    for c in checks:
        names = (c.id.upper(), c.category.value.upper())
        if any(fnmatch.fnmatchcase(n, p) for p in pats for n in names):
            out.append(c)
    return out


def iter_groups(results: Iterable[Result]) -> Iterator[tuple[Category, list[Result]]]:
    """Results grouped by category, in category order."""
    by: dict[Category, list[Result]] = {}
    for r in results:
        by.setdefault(r.check.category, []).append(r)
    for cat in Category:
        if cat in by:
            yield cat, by[cat]
