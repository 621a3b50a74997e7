"""The dissector's rule checks come from the rule table: its violations name the table's ids, and on 8.0.0 rows it
finds what lint finds (the rows rules are read from the generated R.ROWS, not written by hand in the runtime)."""

from __future__ import annotations

import shutil

import pytest
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.spec import V8, Command, encode_reply, encode_request, hello_reply, make_tensor
from ggml_rpc.spec.render.lua_source import generate, rule_tables
from ggml_rpc.spec.rules import RULES
from test_dissector_tshark import run_tshark

ROW_CASES = {
    "ROWS-ZERO": ({"offset": 0, "size": 0, "n_copies": 2, "stride": 16}, b""),
    "ROWS-DATA-LENGTH": ({"offset": 0, "size": 8, "n_copies": 2, "stride": 16}, bytes(8)),
    "ROWS-SPAN-OVERFLOW": ({"offset": 0, "size": 8, "n_copies": 3, "stride": 1 << 63}, bytes(24)),
    "ROWS-PAST-TENSOR": ({"offset": 32, "size": 8, "n_copies": 2, "stride": 32}, bytes(16)),
}


def test_every_rule_id_and_its_text_are_in_the_generated_tables():
    lua = "\n".join(rule_tables())
    for rule in RULES:
        assert f'["{rule.id}"] = {{ level = "{rule.level.value}"' in lua


@pytest.fixture(scope="module")
def lua(tmp_path_factory):
    if shutil.which("tshark") is None:
        pytest.skip("tshark is not installed (.ci/run installs it)")
    path = tmp_path_factory.mktemp("lua") / "ggml_rpc.lua"
    path.write_text(generate())
    return path


@pytest.mark.parametrize("rule", sorted(ROW_CASES))
def test_rows_rules_in_tshark_and_lint(lua, tmp_path, rule):
    fields, data = ROW_CASES[rule]
    t = make_tensor(id=0x40, ne=(16,), buffer=0xB0, data=0x1000, name="rows")
    pcap = tmp_path / "rows.pcap"
    write_session(pcap, [[(True, encode_request(V8, Command.HELLO, {"conn_caps": bytes(24)})),
                          (False, encode_reply(V8, Command.HELLO, hello_reply((8, 0, 0)))),
                          (True, encode_request(V8, Command.SET_TENSOR_2D, {"tensor": t, **fields}, data))]])
    assert [v.rule for v in lint_file(pcap)] == [rule]
    messages = [r[-1] for r in run_tshark(lua, pcap)]
    assert any(f"[{rule}]" in m for m in messages), messages
