"""The CI campaign: a bounded fuzz run against the reference server of each version must find nothing."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.fuzz import Options, embedded_campaign
from ggml_rpc.conformance.fuzz.nearvalid import FLAWS
from ggml_rpc.spec import V6, V7_0_1, Command


@pytest.mark.parametrize("protocol, examples", [(V7_0_1, 60), (V6, 40)], ids=["7.0.1", "6"])
def test_bounded_campaign_against_the_reference_finds_nothing(protocol, examples, tmp_path):
    # Bounded by examples (seeded): the same messages on a fast or a loaded machine.
    campaign = embedded_campaign(protocol, Options(examples=examples, seed=2026, out_dir=tmp_path))
    campaign.target.start()
    try:
        findings = campaign.run()
    finally:
        campaign.target.stop()
    assert [f.line() for f in findings] == []
    assert campaign.stopped_because == "budget spent"
    st = campaign.stats
    assert st.messages > 2000 and st.examples > 5
    # Every command of the table was sent, and every kind of flaw.
    sent = set(st.by_command)
    assert {c.name for c in protocol.commands} <= sent
    assert set(FLAWS) - {"count"} <= set(st.by_flaw)
    assert st.by_command[Command.GRAPH_COMPUTE.name] > 0 and st.restarts == 0
    assert not list(tmp_path.iterdir())
