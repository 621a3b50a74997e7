"""Harness pieces on their own: selection, addresses, verdicts, results, and the terminal report on a terminal."""

from __future__ import annotations

import io

import pytest
from ggml_rpc.conformance.checks import CATALOGUE, by_id
from ggml_rpc.conformance.harness import (
    Category,
    Context,
    EmbeddedTarget,
    Level,
    Outcome,
    RunFacts,
    Runner,
    ServerInfo,
    parse_address,
    select,
    verdict_for,
)
from ggml_rpc.conformance.harness.report import Progress, catalogue_table, results_table
from ggml_rpc.spec import V6, V7, V7_0_1, V8
from rich.console import Console


def test_select_by_id_pattern_and_category() -> None:
    assert [c.id for c in select(CATALOGUE, "HELLO-00[12]")] == ["HELLO-001", "HELLO-002"]
    cache = select(CATALOGUE, "cache-v6, cache-v7")
    assert {c.category for c in cache} == {Category.CACHE_V6, Category.CACHE_V7}
    assert select(CATALOGUE, "iso-*") == [c for c in CATALOGUE if c.id.startswith("ISO-")]
    assert select(CATALOGUE, None) == list(CATALOGUE)
    assert select(CATALOGUE, "NOPE") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:50052", ("127.0.0.1", 50052)), ("[::1]:9", ("::1", 9)), ("localhost:1", ("localhost", 1))],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["localhost", ":80", "host:0", "host:70000", "host:x"])
def test_parse_address_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(text)


def test_verdicts() -> None:
    assert verdict_for((6, 0, 0)) == (V6, "speaks 6.0")
    assert verdict_for((7, 0, 0)) == (V7, "speaks 7.0")
    assert verdict_for((7, 0, 1)) == (V7_0_1, "speaks 7.0.1")
    assert verdict_for((7, 0, 3)) == (V7_0_1, "speaks 7.0.1")  # a later patch speaks at least 7.0.1
    assert verdict_for((8, 0, 0)) == (V8, "speaks 8.0")
    assert verdict_for((9, 0, 0)) == (None, "speaks 9.x: not covered by this kit")
    assert verdict_for((7, 1, 0)) == (None, "speaks 7.1.0: not covered by this kit")


def test_catalogue_is_data() -> None:
    c = by_id("CACHE-V7-003")
    assert c.majors == (7, 8) and c.level is Level.MUST and c.category is Category.CACHE_V7
    assert c.applies_to((7, 0, 0)) and c.applies_to((8, 0, 0)) and not c.applies_to((6, 0, 0))
    assert by_id("DATA-020").applies_to((7, 0, 1)) and not by_id("DATA-020").applies_to((7, 0, 0))
    assert not by_id("DATA-020").applies_to((8, 0, 0))  # 8.0.0's id 19 is GET_TENSOR_2D
    assert by_id("DATA-031").applies_to((8, 0, 0)) and not by_id("DATA-031").applies_to((7, 0, 1))
    assert by_id("FRAME-003").applies_to((7, 0, 0)) and not by_id("FRAME-003").applies_to((7, 0, 1))
    assert by_id("CACHE-V7-003").spec_link(V7) == "spec/PROTOCOL.md#v7-set_tensor"
    assert by_id("FRAME-001").spec_link(V6) == "spec/PROTOCOL.md#enum-commands"


def test_version_rules_are_unsupported_and_results_serialise() -> None:
    with Runner(EmbeddedTarget(V6)) as runner:
        unsupported = runner.run_one(by_id("CACHE-V7-001"))
        passed = runner.run_one(by_id("HELLO-001"))
    assert unsupported.outcome is Outcome.UNSUPPORTED and "server speaks 6.0.0" in unsupported.message
    assert passed.outcome is Outcome.PASS and passed.message == "server speaks 6.0"
    d = passed.as_dict()
    assert d["id"] == "HELLO-001" and d["outcome"] == "pass" and d["spec"] == "spec/PROTOCOL.md#v6-hello"
    assert runner.summary()["unsupported"] == 1 and runner.exit_code() == 0


def test_a_check_runs_on_what_it_may_know_of_the_run_without_a_runner() -> None:
    target = EmbeddedTarget(V7)
    target.start()
    try:
        protocol, verdict = verdict_for(V7.version)
        facts = RunFacts(target, ServerInfo(V7.version, protocol, verdict=verdict), 5.0, 1, V7, {})
        check = by_id("DATA-003")
        ctx = Context(facts, check.id)
        try:
            check.func(ctx)
        finally:
            ctx.close_all()
        assert ctx.connections >= 1 and not hasattr(ctx, "runner") and ctx.expect is V7
        assert ctx.shared("fact", lambda: 42) == 42 and facts.shared == {"fact": 42}
    finally:
        target.stop()


def test_terminal_report_renders_live_lines_and_tables() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    checks = select(CATALOGUE, "HELLO-00[1-3],DATA-003")
    with Runner(EmbeddedTarget(V7)) as runner:
        progress = Progress(console, {Category.HANDSHAKE: 3, Category.DATA: 1})
        runner.run(checks, progress.update)
        progress.close()
    console.print(results_table(runner.results))
    console.print(catalogue_table(checks))
    text = out.getvalue()
    assert "handshake" in text and "3/3" in text and "1/1" in text
    for c in checks:
        assert c.id in text
