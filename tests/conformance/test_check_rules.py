"""Each check names the rules of the rule table (``spec.rules``) it enforces, and names them right.

What a check's own requests break is measured, not declared: the whole catalogue runs against the reference server of
every major and each check's exchange goes through ``ggml-rpc lint``'s checker.  A client rule its requests break is
one the check enforces (it sends the request for the server to refuse it) unless the table below says the check only
uses such a request to set something up; a client rule a check names must show up in its exchange.  The server rules
(a reply's size, no reply bytes for a command without one) are judged against each check's breaker, in
``test_check_breakers.py``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.checks.figures import RULES_ANCHOR, page
from ggml_rpc.conformance.harness import SPEC_DOC, Category, EmbeddedTarget, Runner
from ggml_rpc.conformance.sessions.lint import lint_connections
from ggml_rpc.spec import V6, V7, V8
from ggml_rpc.spec.rules import BY_ID, Side

ROOT = Path(__file__).resolve().parents[2]

#: The shadow checks judge where a write's bytes land, not whether it is refused: a request of theirs that breaks a
#: client rule passes when the server refuses it and when it writes inside its destination only.
_WHERE_BYTES_LAND = ("the check passes a refusal and a write that stays inside its destination alike: it judges "
                     "where the bytes go, not the refusal")
#: Client rules a check's requests break only to set up what it judges (the server is expected to go on), and why:
#: the check does not enforce them.  Every entry must still be broken (no stale excuse).
SET_UP_WITH: dict[str, dict[str, str]] = {
    **{check_id: {"ROWS-PAST-TENSOR": _WHERE_BYTES_LAND} for check_id in ("SHADOW-005", "SHADOW-006")},
    **{check_id: {"COPY-FITS-DST": _WHERE_BYTES_LAND} for check_id in ("SHADOW-010", "SHADOW-011")},
}

#: Categories whose checks may name no rule, and why: what they judge is not a rule of the table (which states what
#: one message and its connection's cache state may be), or not only.
MAY_NAME_NONE: dict[Category, str] = {
    Category.HANDSHAKE: "the HELLO reply's fields and the device count are a version's layout, not rules",
    Category.FRAMING: "refusals that depend on the server's state (devices, handles, buffers, stored graphs) and "
                      "upstream's memory-safety classes, judged by what the server does, not by the message alone",
    Category.DATA: "what the server does with valid requests (data written and read back, sizes, alignment)",
    Category.CACHE_V6: "the version's cache behaviour, observed through hits and misses",
    Category.CACHE_V7: "the version's cache behaviour, observed through hits and misses",
    Category.ISOLATION: "which connection owns a buffer: the server's state",
    Category.COMPUTE: "computed results, compared with the reference executor's",
    Category.COMM: "the communicator's answers and its sum (the servers' link is not part of a check's exchange)",
}


def _client_rules(rules: set[str]) -> set[str]:
    return {r for r in rules if r in BY_ID and BY_ID[r].side is Side.CLIENT}


@pytest.fixture(scope="module")
def broken_by_requests() -> dict[str, set[str]]:
    """Every check's id -> the client rules its exchanges with the reference servers (6, 7, 8) break."""
    found: dict[str, set[str]] = defaultdict(set)
    for protocol in (V6, V7, V8):
        runner = Runner(EmbeddedTarget(protocol), expect=protocol, timeout=30.0)
        runner.start()
        try:
            for check in CATALOGUE:
                result = runner.run_one(check)
                if result.recording is None:
                    continue
                violations = lint_connections([c.capture() for c in result.recording.connections])
                found[check.id] |= _client_rules({v.rule for v in violations})
        finally:
            runner.stop()
    return found


def test_every_rule_a_check_names_is_in_the_table() -> None:
    unknown = {c.id: sorted(set(c.rules) - set(BY_ID)) for c in CATALOGUE if set(c.rules) - set(BY_ID)}
    assert not unknown
    twice = [c.id for c in CATALOGUE if len(set(c.rules)) != len(c.rules)]
    assert not twice


def test_the_set_up_table_names_checks_and_client_rules() -> None:
    ids = {c.id for c in CATALOGUE}
    assert set(SET_UP_WITH) <= ids
    for rules in SET_UP_WITH.values():
        assert rules and _client_rules(set(rules)) == set(rules)


def test_a_check_names_exactly_the_client_rules_its_requests_break(broken_by_requests) -> None:
    wrong = {}
    for check in CATALOGUE:
        set_up = set(SET_UP_WITH.get(check.id, {}))
        if not set_up <= broken_by_requests[check.id]:
            wrong[check.id] = {"set up with, but not broken": sorted(set_up - broken_by_requests[check.id])}
            continue
        enforced = broken_by_requests[check.id] - set_up
        named = _client_rules(set(check.rules))
        if named != enforced:
            wrong[check.id] = {"named": sorted(named), "its requests break": sorted(enforced)}
    assert not wrong


def test_a_check_that_names_no_rule_is_of_a_category_the_table_does_not_state() -> None:
    assert not [c.id for c in CATALOGUE if not c.rules and c.category not in MAY_NAME_NONE]
    assert set(MAY_NAME_NONE) <= {c.category for c in CATALOGUE if not c.rules}  # no stale category


def test_the_catalogue_page_links_each_check_to_its_rules_and_its_section() -> None:
    text = page(CATALOGUE)
    lines = {line.split(" | ", 1)[0].removeprefix("| "): line for line in text.splitlines() if line.startswith("| ")}
    protocol_md = (ROOT / SPEC_DOC).read_text(encoding="utf-8")
    assert f'<a id="{RULES_ANCHOR.partition("#")[2]}"></a>' in protocol_md
    for check in CATALOGUE:
        line = lines[check.id]
        assert all(f"[`{r}`]({RULES_ANCHOR})" in line for r in check.rules), line
        assert check.rules or line.endswith("| — |"), line
        anchor = check.spec_link(None).partition("#")[2]
        assert f'<a id="{anchor}"></a>' in protocol_md, f"{check.id}: no anchor {anchor} in {SPEC_DOC}"
