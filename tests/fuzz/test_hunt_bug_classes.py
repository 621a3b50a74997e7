"""The hunt's strategies for upstream's memory-safety bug classes A-F (SECURITY.md): each one, run alone, sends messages
the spec's decoder reads back as the same command, reaches the class it is named for, and the embedded reference
survives all of it with no finding (it refuses or computes safely what upstream crashes on or corrupts)."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.fuzz import Options
from ggml_rpc.conformance.fuzz import campaign as campaign_mod
from ggml_rpc.conformance.fuzz import hunt as hunt_mod
from ggml_rpc.conformance.fuzz import hunt_strategies as hs
from ggml_rpc.conformance.fuzz.hunt import embedded_hunt
from ggml_rpc.spec import V6, V7, RequestDecoder
from hunting import run_clean

#: (strategy, the tag its broken messages carry)
NEW = [
    (hs.block_misaligned, "block"),
    (hs.size_arithmetic, "arith"),
    (hs.foreign_buffer, "buffer"),
    (hs.graph_structure, "graph"),
    (hs.kernel_bounds, "kernel"),
    (hs.custom_op, "custom"),
]
EXAMPLES = 8
STEPS = 6


def test_every_new_strategy_is_weighted_in_the_hunt() -> None:
    picked = {fn for _w, fn in hs.STRATEGIES}
    assert {fn for fn, _tag in NEW} <= picked
    assert all(w > 0 for w, _fn in hs.STRATEGIES)


@pytest.mark.parametrize("protocol", [V7, V6], ids=["7", "6"])
@pytest.mark.parametrize(("strategy", "tag"), NEW, ids=[tag for _fn, tag in NEW])
def test_strategy_alone_decodes_and_the_reference_survives_it(monkeypatch, tmp_path, protocol, strategy, tag) -> None:
    sent = []
    count = campaign_mod.Campaign.count_message

    def recording(self, msg) -> None:
        sent.append(msg)
        count(self, msg)

    monkeypatch.setattr(campaign_mod.Campaign, "count_message", recording)
    monkeypatch.setattr(hunt_mod, "strategy", lambda rng: strategy)
    monkeypatch.setattr(hunt_mod, "STRATEGY_PERCENT", 100)
    hunt = embedded_hunt(protocol, Options(examples=EXAMPLES, seed=5, out_dir=tmp_path, timeout=2.0, steps=STEPS))
    run_clean(hunt)
    aimed = [m for m in sent if m.tags and m.tags[0] == tag]
    assert len(aimed) >= EXAMPLES, (tag, dict(hunt.stats.by_flaw))
    assert all(m.broken for m in aimed)
    for msg in aimed:
        wire, _end = msg.encode(protocol)
        # framing only: the content rules these messages break are the point of them
        [decoded] = RequestDecoder(protocol, expect_hello=False, validate=False).feed(wire)
        assert decoded.command is msg.command, msg.describe()
