"""The Lua dissector is derived from the spec tables: every field appears, and changing the spec changes it."""

from __future__ import annotations

import re

import pytest
from construct import Array, Bytes, GreedyBytes, Int8ul, Int16ul, Int32ul, Int64ul, Struct
from ggml_rpc.conformance.cli import main
from ggml_rpc.spec import PROTOCOLS, V6, V7, V7_0_1, Command, Payload, Shape, TensorFlag
from ggml_rpc.spec.messages import NO_REPLY, SET_TENSOR_V7_REQ
from ggml_rpc.spec.render.lua_source import GeneratorError, describe_fields, generate, lua_str
from ggml_rpc.spec.tensor import RpcTensor
from ggml_rpc.spec.versions import CommandSpec


@pytest.fixture(scope="module")
def source() -> str:
    return generate()


def _field_names(schema: Struct, prefix: str = "ggml_rpc") -> set[str]:
    """Abbreviations the dissector should declare for a Struct (nested rpc_tensor fields under ggml_rpc.tensor)."""
    out = set()
    for sub in schema.subcons:
        inner = sub.subcon if hasattr(sub, "subcon") else sub
        while hasattr(inner, "subcon") and not isinstance(inner, Struct):
            inner = inner.subcon
        if isinstance(inner, Struct):
            out.add("ggml_rpc.tensor")
            out |= _field_names(inner, "ggml_rpc.tensor")
        else:
            out.add(f"{prefix}.{sub.name}")
    return out


def test_every_field_of_every_payload_of_every_version_is_declared(source):
    declared = set(describe_fields(source))
    wanted = set()
    for proto in PROTOCOLS:
        for spec in proto.commands.values():
            wanted |= _field_names(spec.request.schema)
            if spec.has_reply:
                wanted |= _field_names(spec.reply.schema)
    assert wanted <= declared, sorted(wanted - declared)
    for flag in TensorFlag:
        assert f"ggml_rpc.tensor.flags.{flag.name.lower()}" in declared


def test_doc_strings_are_the_blurbs(source):
    for sub in RpcTensor.subcons:
        assert lua_str(sub.docs) in source, sub.name
    cache_flag = SET_TENSOR_V7_REQ.schema.subcons[1]
    assert cache_flag.name == "cache_flag" and lua_str(cache_flag.docs) in source


def test_one_table_per_version_with_its_commands(source):
    for proto in PROTOCOLS:
        block = source.split(f'label = "{proto.label}"', 1)[1].split("} }", 1)[0]
        names = re.findall(r'name = "([A-Z_0-9]+)", request', block)
        assert names == [c.name for c in proto.commands]
        for cmd, spec in proto.commands.items():
            line = next(ln for ln in block.splitlines() if f'name = "{cmd.name}"' in ln)
            assert ("reply = nil" in line) == (not spec.has_reply)
    assert "GET_DEVICE_SUPPORTS_OP" not in source.split('label = "7.0.0"', 1)[1].split("} }", 1)[0]


def test_layout_sizes_come_from_construct(source):
    sizes = {int(n) for n in re.findall(r"LAYOUTS\[\d+\] = \{ size = (\d+)", source)}
    assert RpcTensor.sizeof() in sizes
    for proto in PROTOCOLS:
        for spec in proto.commands.values():
            if spec.request.shape is not Shape.GRAPH:
                assert spec.request.schema.sizeof() in sizes | {0}
    # the HELLO reply's version bytes are found by name, not by a constant of the runtime
    assert "HELLO_MAJOR_OFF = 0," in source and "HELLO_PATCH_OFF = 2," in source


def test_enum_names_come_from_the_spec(source):
    assert '[19] = "GET_DEVICE_SUPPORTS_OP"' in source
    assert '[39] = "MXFP4"' in source and '[4] = "REMOVED_Q4_2"' in source
    assert '[100] = "GLU"' in source and '[10] = "SILU"' in source


def test_changing_a_payload_changes_the_dissector(source):
    """A modified copy of the v7 SET_TENSOR Struct (one more field) is what the generated Lua decodes."""
    changed = Payload(
        Shape.HEADER_DATA,
        Struct(*SET_TENSOR_V7_REQ.schema.subcons[:2], "priority" / Int16ul * "a field the spec does not have",
               *SET_TENSOR_V7_REQ.schema.subcons[2:]),
        SET_TENSOR_V7_REQ.doc,
    )
    v7x = V6.derive((7, 0, 0), replace={Command.SET_TENSOR: CommandSpec(Command.SET_TENSOR, changed, NO_REPLY, "x")})
    lua = generate([V6, v7x])
    assert lua != generate([V6, V7])
    assert "ggml_rpc.priority" in lua and "ggml_rpc.priority" not in source
    assert '"a field the spec does not have"' in lua
    assert f"size = {SET_TENSOR_V7_REQ.header_size + 2}," in lua


def test_changing_the_tensor_struct_changes_every_tensor(source):
    tensor = Struct(*RpcTensor.subcons, "uid" / Int64ul * "a later field")
    req = Payload(Shape.FIXED, Struct("tensor" / tensor * "t"), "init")
    v6x = V6.derive((6, 0, 0), replace={Command.INIT_TENSOR: CommandSpec(Command.INIT_TENSOR, req, NO_REPLY, "x")})
    lua = generate([v6x])
    assert "ggml_rpc.tensor.uid" in lua
    assert f"size = {RpcTensor.sizeof() + 8}" in lua


def test_removing_a_reply_changes_the_pairing(source):
    no_reply = V6.derive((6, 0, 0), replace={
        Command.COPY_TENSOR: CommandSpec(Command.COPY_TENSOR, V6.commands[Command.COPY_TENSOR].request, NO_REPLY, "x")
    })
    line = next(ln for ln in generate([no_reply]).splitlines() if 'name = "COPY_TENSOR"' in ln)
    assert "reply = nil" in line
    assert "reply = nil" not in next(ln for ln in source.splitlines() if 'name = "COPY_TENSOR"' in ln)


def test_only_given_versions_are_covered():
    lua = generate([V7, V7_0_1])
    assert 'label = "6.0.0"' not in lua and 'label = "7.0.1"' in lua


def test_unsupported_field_kinds_are_refused():
    bad = Payload(Shape.FIXED, Struct("blob" / GreedyBytes), "x")
    v = V6.derive((6, 0, 0), replace={Command.HELLO: CommandSpec(Command.HELLO, bad, V6.commands[Command.HELLO].reply,
                                                                   "x")})
    with pytest.raises(GeneratorError, match="blob"):
        generate([v])
    clash = Payload(Shape.FIXED, Struct("device" / Int8ul, "x" / Array(2, Int32ul), "y" / Bytes(3)), "x")
    reply = V6.commands[Command.GET_ALIGNMENT].reply
    v = V6.derive((6, 0, 0), replace={Command.GET_ALIGNMENT: CommandSpec(Command.GET_ALIGNMENT, clash, reply, "")})
    with pytest.raises(GeneratorError, match=r"ggml_rpc\.device"):
        generate([v])


def test_lua_strings_are_escaped():
    assert lua_str('a "b" \\ c\n') == '"a \\"b\\" \\\\ c\\n"'
    assert lua_str("\x01") == '"\\001"'


def test_cli_writes_the_file(tmp_path, capsys):
    out = tmp_path / "ggml_rpc.lua"
    assert main(["dissector", "-o", str(out)]) == 0
    assert out.read_text() == generate()
    assert main(["dissector", "--port", "50099"]) == 0
    assert "PORT = 50099," in capsys.readouterr().out


def test_cli_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["dissector", "--port", "70000"])
    assert exc.value.code == 2
    assert "argument --port: expected a TCP port 1..65535" in capsys.readouterr().err
    assert main(["dissector", "-o", str(tmp_path / "missing" / "x.lua")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_runtime_names_no_command_but_the_handshake():
    """The fixed Lua runtime knows framing only: every command-specific fact comes from the generated tables."""
    from ggml_rpc.spec.render.lua_runtime import RUNTIME

    named = [c.name for c in Command if re.search(rf"(?<![.\w]){c.name}\b", RUNTIME)]
    assert named == ["HELLO"]  # the handshake rule; its id and sizes still come from the tables (C.HELLO...)
    assert not re.search(r"\b(?:296|304|305|24|28)\b", RUNTIME)  # no layout size written by hand
