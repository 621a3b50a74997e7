"""The oracle and a target's memory budget: no wrong-reply where only the budgets differ.

A reference server with its default budget (4 GiB per device) grants a 4 GiB allocation; a model with the fuzzer's
small budget refuses it, then grants the next small allocation that the target (budget used up) must refuse.
"""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.fuzz import FUZZ_DEVICE_MEMORY, Campaign, Options, fuzz_config, learn_target, target_campaign
from ggml_rpc.conformance.fuzz.findings import FuzzFinding
from ggml_rpc.conformance.fuzz.message import FuzzMessage
from ggml_rpc.conformance.harness import ExternalTarget
from ggml_rpc.reference import running_server
from ggml_rpc.reference.devices import DEFAULT_MEMORY
from ggml_rpc.spec import V7, Command

LARGE = 1 << 32  # a near-valid size the fuzzer draws: exactly the default budget


@pytest.fixture
def default_server():
    with running_server("7") as srv:
        yield srv


def _large_then_small(campaign: Campaign):
    """A forced 4 GiB allocation, then a small one on the same connection; the example (still open)."""
    ex = campaign.new_example()
    ref = ex.active()
    ex.send(ref, FuzzMessage(Command.ALLOC_BUFFER, {"device": 0, "size": LARGE}))
    small = ex.alloc(ref, 4096, 0)
    return ex, small


def test_setup_learns_the_announced_memory(default_server):
    facts = learn_target(default_server.host, default_server.port)
    assert facts.memory == DEFAULT_MEMORY
    campaign = target_campaign(ExternalTarget(default_server.host, default_server.port), Options())
    assert campaign.model_config.device.memory == DEFAULT_MEMORY


def test_large_allocation_on_a_default_budget_server_is_no_finding(default_server, tmp_path):
    campaign = target_campaign(ExternalTarget(default_server.host, default_server.port), Options(out_dir=tmp_path))
    ex, small = _large_then_small(campaign)
    try:
        # Same budget on both sides: both grant 4 GiB, both refuse the next 4 KiB, and the example goes on.
        assert small is None and ex.finding is None and not ex.untracked
        assert ex.alloc(ex.active(), 0, 0) is not None  # the zero-size dummy buffer needs no budget
    finally:
        ex.finish()  # closes cleanly and checks the target still answers
    assert ex.finding is None
    assert not list(tmp_path.iterdir())


def test_budget_smaller_than_the_target_stops_judging_instead_of_a_false_wrong_reply(default_server, tmp_path):
    # The model as it was before the budget was learnt: 64 MiB against a 4 GiB target.
    config = fuzz_config(V7)
    assert config.device.memory == FUZZ_DEVICE_MEMORY < LARGE
    campaign = Campaign(ExternalTarget(default_server.host, default_server.port), V7, config,
                        Options(out_dir=tmp_path), devices=1, alignment=config.device.alignment)
    ex, small = _large_then_small(campaign)
    try:
        assert ex.finding is None and small is None
        assert ex.memory_diverged and ex.untracked and ex.inert
        assert ex.send(ex.active(), FuzzMessage(Command.DEVICE_COUNT, {})) is None  # nothing is judged any more
    finally:
        ex.finish()
    assert ex.finding is None and not list(tmp_path.iterdir())


def test_the_embedded_reference_is_still_judged_exactly(tmp_path):
    # Exact mode (the model shares the target's configuration): a refused allocation the model grants is a finding.
    config = fuzz_config(V7)
    with running_server("7", mem=config.device.memory // 2) as srv:
        campaign = Campaign(ExternalTarget(srv.host, srv.port), V7, config,
                            Options(out_dir=tmp_path, exact=True), devices=1, alignment=config.device.alignment)
        ex = campaign.new_example()
        ref = ex.active()
        with pytest.raises(FuzzFinding, match="allocation"):
            ex.send(ref, FuzzMessage(Command.ALLOC_BUFFER, {"device": 0, "size": config.device.memory}))
        ex.finish()
