"""The executor's one-token products against each installed build's own ggml_vec_dot_*, the 8.0.0 wheel included
(through its private loader): every type bit for bit, each computed as that version's build computes it."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.upstream.vec_dot_check import check_peer, checked_types, main

pytestmark = pytest.mark.upstream


def _assert_exact(result: dict[str, list[int]]) -> None:
    assert set(result) == set(checked_types())
    for name, (differ, compared) in result.items():
        assert compared > 0, name
        assert differ == 0, f"{name}: {differ} of {compared} outputs differ"


def test_every_product_is_7_0_0s(upstream_peer) -> None:
    _assert_exact(check_peer(upstream_peer))


def test_every_product_is_8_0_0s(upstream_peer8) -> None:
    _assert_exact(check_peer(upstream_peer8))


def test_8_0_0s_q2_0_is_not_computed_as_7_0_0s(upstream_peer8) -> None:
    # The build table matters: 8.0.0's Q2_0 kernel, judged as 7.0.0's build computes it, differs.
    result = check_peer(upstream_peer8, ["Q2_0"], major=7)
    assert result["Q2_0"][0] > 0


def test_unknown_type_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["/nonexistent", "--major", "7", "--types", "F99"])
    assert exc.value.code == 2
    assert "unknown or unchecked type 'F99'" in capsys.readouterr().err


def test_missing_libraries_are_reported(tmp_path, capsys) -> None:
    assert main([str(tmp_path), "--major", "7"]) == 2
    assert "cannot load the build's libraries" in capsys.readouterr().err
