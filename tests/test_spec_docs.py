"""The generated protocol reference: complete, derived from the tables, checked in up to date."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from construct import Int16ul, Renamed, Struct
from ggml_rpc.conformance.cli import main
from ggml_rpc.spec import PROTOCOLS, V6, V7, V7_0_1, Command, CommandSpec, Payload
from ggml_rpc.spec.render.markdown import changes_anchor, command_anchor, render_markdown, version_slug

ROOT = Path(__file__).resolve().parent.parent
CHECKED_IN = ROOT / "spec" / "PROTOCOL.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return render_markdown()


def _section(doc: str, anchor: str) -> str:
    """The text from an anchor to the next anchor."""
    start = doc.index(f'<a id="{anchor}"></a>')
    nxt = doc.find("<a id=", start + 1)
    return doc[start : nxt if nxt >= 0 else len(doc)]


def test_checked_in_reference_is_current(doc):
    assert CHECKED_IN.read_text(encoding="utf-8") == doc, (
        "spec/PROTOCOL.md is stale: regenerate it with `ggml-rpc spec > spec/PROTOCOL.md`"
    )


def test_anchor_scheme():
    assert [version_slug(p) for p in PROTOCOLS] == ["v6", "v7", "v7-0-1", "v8"]
    assert command_anchor(V7, Command.SET_TENSOR) == "v7-set_tensor"
    assert command_anchor(V7_0_1, 19) == "v7-0-1-get_device_supports_op"
    assert changes_anchor(V7) == "changes-v6-v7"
    assert changes_anchor(V7_0_1) == "changes-v7-v7-0-1"
    with pytest.raises(ValueError):
        changes_anchor(V6)


def test_anchors_unique_and_every_internal_link_resolves(doc):
    anchors = re.findall(r'<a id="([^"]+)"></a>', doc)
    assert len(anchors) == len(set(anchors))
    links = set(re.findall(r"\]\(#([^)]+)\)", doc))
    assert links, "the reference links its sections"
    assert links <= set(anchors), links - set(anchors)


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.label)
def test_every_command_has_a_section_with_request_and_reply(doc, protocol):
    for cmd, spec in protocol.commands.items():
        section = _section(doc, command_anchor(protocol, cmd))
        assert f"### {cmd.name} ({protocol.wire_id(cmd)}) — {protocol.label}" in section
        assert "**Request**" in section
        if spec.has_reply:
            assert "**Reply**" in section and "**No reply**" not in section
        else:
            assert "**No reply**" in section and "**Reply**" not in section
        assert spec.request.doc in section


def test_field_rows_have_offsets_sizes_types_and_docs(doc):
    v6 = _section(doc, "v6-set_tensor")
    v7 = _section(doc, "v7-set_tensor")
    assert "| 296 | 8 | u64 | `offset` | byte offset from tensor.data |" in v6
    assert "| 304 | n | bytes | `data` |" in v6
    assert "| 296 | 1 | u8 | `cache_flag` | non-zero: the server saves" in v7
    assert "| 297 | 8 | u64 | `offset` |" in v7
    assert "| 305 | n | bytes | `data` |" in v7
    graph = _section(doc, "v6-graph_compute")
    assert "| 8 | 8·n_nodes | u64[n_nodes] | `nodes` |" in graph
    assert "| 12 + 8·n_nodes | 296·n_tensors | [rpc_tensor](#rpc_tensor)[n_tensors] | `tensors` |" in graph
    tensor = _section(doc, "rpc_tensor")
    assert "## rpc_tensor (296 bytes)" in tensor
    assert "| 12 | 8 | u64 | `buffer` |" in tensor
    assert "| 292 | 4 | i32 | `use_count` |" in tensor
    hello = _section(doc, "v7-hello")
    assert "| 0 | 1 | u8 | `major` |" in hello and "| 4 | 24 | u8[24] | `conn_caps` |" in hello
    assert "Empty payload" in _section(doc, "v6-device_count")
    assert "| 0 | request.size | bytes | `data` |" in _section(doc, "v6-get_tensor")


def test_version_facts(doc):
    assert "`1c 00 00 00 00 00 00 00` `06 00 00 00` + 24 zero bytes" in _section(doc, "v6")
    assert "`1c 00 00 00 00 00 00 00` `07 00 00 00` + 24 zero bytes" in _section(doc, "v7")
    assert "`1c 00 00 00 00 00 00 00` `07 00 01 00` + 24 zero bytes" in _section(doc, "v7-0-1")
    assert "| `save_above` | `10485760` |" in _section(doc, "v6-cache-rule")
    assert "| `flag_field` | `'cache_flag'` |" in _section(doc, "v7-cache-rule")


def test_generated_changes(doc):
    six_seven = _section(doc, "changes-v6-v7")
    assert "| HELLO reply `major` | 6 | 7 |" in six_seven
    assert "request `offset` offset | 296 | 297 |" in six_seven
    assert "request `cache_flag` | — | added at 296, size 1, u8" in six_seven
    assert "`save_above` | `10485760` | `None` |" in six_seven
    for sentence in V7.changes:
        assert sentence in six_seven
    # Commands the table leaves alone are not mentioned.
    assert "GET_TENSOR" not in six_seven and "GRAPH_COMPUTE" not in six_seven
    patch = _section(doc, "changes-v7-v7-0-1")
    assert "| RPC_CMD_COUNT | 19 | 20 |" in patch
    assert "| HELLO reply `patch` | 0 | 1 |" in patch
    assert "GET_DEVICE_SUPPORTS_OP](#v7-0-1-get_device_supports_op) (19) | — (the server closes) | added" in patch
    eight = _section(doc, "changes-v7-v8")
    assert "| NONE (client-side sentinel) | id 18 | id 23 |" in eight
    assert "[GET_TENSOR_2D](#v8-get_tensor_2d) (19) | — (the server closes) | added" in eight
    assert "request `uid` | — | added at 4, size 8, u64" in eight


def test_enum_tables(doc):
    commands = _section(doc, "enum-commands")
    assert "| NONE | 18: never on the wire" in commands and "| 23: never on the wire" in commands
    assert ("| GET_DEVICE_SUPPORTS_OP | — | — | 19: [3260 / reply 1](#v7-0-1-get_device_supports_op) | — |"
            in commands)
    assert ("| GET_TENSOR_2D | — | — | — | 19: [328 / reply request.size × request.n_copies bytes]"
            "(#v8-get_tensor_2d) |") in commands
    types = _section(doc, "enum-types")
    assert "| 4 | REMOVED_Q4_2 | 0 | 0 | removed |" in types
    assert "| 12 | Q4_K | 256 | 144 | quantized |" in types
    ops = _section(doc, "enum-ops")
    assert ops.count("\n| ") == 1 + 101  # header + every op
    assert "| 95 | CUSTOM | op_params hold a native function pointer |" in ops
    assert "| 21 | TRUNC |" in _section(doc, "enum-unary")
    assert "| 5 | GEGLU_QUICK |" in _section(doc, "enum-glu")
    assert "| 16 | COMPUTE |" in _section(doc, "enum-flags")


def _with_field_doc(payload: Payload, field: str, doc: str) -> Payload:
    subcons = [Renamed(sub, newdocs=doc) if sub.name == field else sub for sub in payload.schema.subcons]
    return Payload(payload.shape, Struct(*subcons), payload.doc, payload.length_from)


def test_docs_derive_from_the_table():
    """A derived copy of a table with one changed doc string and one extra field changes the output accordingly."""
    old = V7.commands[Command.GET_TENSOR]
    changed = _with_field_doc(old.request, "offset", "a doc string only this test writes")
    grown = Payload(changed.shape, Struct(*changed.schema.subcons, "extra" / Int16ul * "a test-only field"),
                    changed.doc)
    table = V7.derive((7, 9, 0), replace={Command.GET_TENSOR: CommandSpec(Command.GET_TENSOR, grown, old.reply,
                                                                          old.doc)})
    text = render_markdown([V7, table])
    section = _section(text, "v7-9-0-get_tensor")
    assert "| 296 | 8 | u64 | `offset` | a doc string only this test writes |" in section
    assert "| 312 | 2 | u16 | `extra` | a test-only field |" in section
    assert "fixed, exactly 314 bytes" in section
    changes = _section(text, "changes-v7-v7-9-0")
    assert "request `offset` description | byte offset from tensor.data | a doc string only this test writes |" in (
        changes
    )
    assert "request `extra` | — | added at 312, size 2, u16: a test-only field |" in changes
    assert "| HELLO reply `minor` | 0 | 9 |" in changes
    # The original table's text is untouched.
    assert "a doc string only this test writes" not in render_markdown([V7])


def test_single_version_rendering_links_only_what_it_contains():
    text = render_markdown([V7])
    assert '<a id="v7-set_tensor"></a>' in text and '<a id="v6-set_tensor"></a>' not in text
    assert "Unchanged since 6.0.0" in text
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    assert set(re.findall(r"\]\(#([^)]+)\)", text)) <= anchors


def test_cli_spec_prints_the_reference(capsys, doc):
    assert main(["spec"]) == 0
    assert capsys.readouterr().out == doc
    assert main(["spec", "--proto", "7.0.1"]) == 0
    out = capsys.readouterr().out
    assert out == render_markdown([V7_0_1])
    assert '<a id="v7-0-1-get_device_supports_op"></a>' in out


def test_cli_spec_rejects_unknown_version(capsys):
    assert main(["spec", "--proto", "9"]) == 2
    err = capsys.readouterr().err
    assert "unknown protocol version '9'" in err and "Traceback" not in err


# ---- what an implementer needs beyond the layouts ----------------------------------------------------------------


def test_framing_names_the_size_header_apart_from_payload_fields(doc):
    framing = _section(doc, "framing")
    assert "| 1 | 8 | u64 | `payload_size` |" in framing and "| 0 | 8 | u64 | `payload_size` |" in framing
    assert "request or reply" not in framing
    assert "the request payload" in framing and "the reply payload" in framing
    rows = _section(doc, "v8-set_tensor_2d")
    # The per-row `size` field and the size header are two names: the data row counts from the header's.
    assert "| 304 | 8 | u64 | `size` | bytes per row" in rows
    assert "(n = payload_size − 328)" in rows and "payload_size ≥ 328" in rows
    assert "(n = size −" not in doc and "any other size header" not in doc


def test_shapes_and_nbytes_are_defined_once_and_linked(doc):
    shapes = _section(doc, "tensor-shape")
    assert "unused `ne` to **1**, never 0" in shapes
    assert "`nb[0]` = `size`" in shapes and "`nb[1]` = `size` × `ne[0]` / `blck`" in shapes
    nbytes = _section(doc, "nbytes")
    assert "if any `ne[i]` is 0: 0" in nbytes
    assert "| F32 (blck 1, size 4) | `{16, 1, 1, 1}` | `{4, 64, 64, 64}` | 64 |" in nbytes
    assert "| Q4_0 (blck 32, size 18) | `{64, 2, 1, 1}` | `{18, 36, 72, 72}` | 72 |" in nbytes
    assert "| F32 (blck 1, size 4) | `{16, 0, 0, 0}` | `{4, 64, 64, 64}` | 0 |" in nbytes
    assert doc.count('<a id="nbytes"></a>') == 1
    # The rules and field tables that rest on nbytes point at its one definition.
    rules = _section(doc, "rules")
    for rule in ("REGION-PAST-TENSOR", "ROWS-PAST-TENSOR", "COPY-FITS-DST"):
        line = next(r for r in rules.splitlines() if f"`{rule}`" in r)
        assert "[nbytes](#nbytes)" in line, line
    assert "([nbytes](#nbytes)(src) bytes are copied)" in _section(doc, "v6-copy_tensor")


def test_computing_a_graph_says_what_gets_a_result(doc):
    compute = _section(doc, "compute")
    assert "**`flags` with COMPUTE (16) set**" in compute
    assert "skips a node without COMPUTE silently" in compute
    assert "one rpc_tensor for each node **and** for every tensor reachable" in compute
    assert "`n_nodes` their number" in compute and "`n_tensors` their number" in compute
    assert "[GET_TENSOR](#v8-get_tensor) of the node's tensor" in compute
    assert "`use_count`" in compute and "RMS_NORM" in compute
    example = _section(doc, "compute-example")
    assert "| c | 3 | F32 (0) | `{4, 2, 1, 1}` | `{4, 16, 32, 32}` | ADD (2) | 16 | 1, 2 | base + 64 |" in example
    assert "908 bytes (6.0.0, 7.0.0, 7.0.1); 916 bytes (8.0.0, with its `uid`)" in example


def test_session_caps_alignment_failures_and_hash(doc):
    assert "sends 24 zero bytes" in _section(doc, "hello-caps")
    assert "The server never checks the client's version" in _section(doc, "hello-caps")
    assert "multiple of GET_ALIGNMENT's answer" in _section(doc, "alignment")
    failures = _section(doc, "failures")
    assert "There is no error reply" in failures and "end-of-stream" in failures
    assert "GRAPH_COMPUTE, GRAPH_RECOMPUTE" in failures
    hashing = _section(doc, "hash")
    assert "`0xcbf29ce484222325`" in hashing and "`0x100000001b3`" in hashing
    assert '| `"a"` | `0xaf63dc4c8601ec8c` | `af63dc4c8601ec8c` |' in hashing
    assert "op id is ggml's own enum value as compiled into the server" in _section(doc, "enum-ops")
    assert "(see [shapes](#tensor-shape))" in _section(doc, "rpc_tensor")


def test_empty_ops_are_the_executors_free_ops():
    from ggml_rpc.reference.executor.plan import FREE_OPS
    from ggml_rpc.spec.enums import EMPTY_OPS

    assert set(EMPTY_OPS) == set(FREE_OPS)
