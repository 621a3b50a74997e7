"""The generation figure: llama-completion's timing line parsed, and (with upstream installed) one short round per
server measured end to end.  Nothing here asserts a speed."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.upstream.generation import GenerationResult, ServerRounds, measure, tokens_per_second

LOG = """\
       load time =     120.10 ms
prompt eval time =      10.75 ms /     5 tokens (    2.15 ms per token,   465.12 tokens per second)
       eval time =     144.32 ms /    63 runs   (    2.29 ms per token,   436.52 tokens per second)
      total time =     180.00 ms /    68 tokens
"""


def test_the_generation_line_is_read_not_the_prompt_line() -> None:
    assert tokens_per_second(LOG) == 436.52


def test_no_timing_line_reads_as_none() -> None:
    assert tokens_per_second("llama_model_load: error loading model\n") is None


def test_ratio_is_reference_over_upstream_medians() -> None:
    result = GenerationResult("bench-f32", "7.0.0", 64, ServerRounds("reference", [100.0, 300.0, 200.0]),
                              ServerRounds("upstream", [400.0, 400.0, 500.0]))
    assert result.ratio == 0.5
    assert result.as_dict()["reference_median"] == 200.0


def test_unknown_model_is_refused_before_anything_runs(upstream_peer) -> None:
    with pytest.raises(ValueError, match="unknown bench model"):
        measure(upstream_peer, ("no-such-model",))


@pytest.mark.upstream
def test_one_round_through_each_server(upstream_peer) -> None:
    (result,) = measure(upstream_peer, ("bench-f32",), rounds=1, n_predict=8)
    assert len(result.reference.rounds) == len(result.upstream.rounds) == 1
    assert result.reference.median > 0 and result.upstream.median > 0
