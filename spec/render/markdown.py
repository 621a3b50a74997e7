"""The Markdown protocol reference, generated from the schemas (``ggml-rpc spec``, checked in as ``PROTOCOL.md``).

Nothing in the output is written by hand: field tables come from walking the construct Structs of each version's
command table (offsets, sizes and types computed, descriptions from the construct doc strings), the enum tables
from :mod:`ggml_rpc.spec.enums`, the HELLO bytes from the codec, and each "A -> B" section from diffing the two
tables field by field.  Only the framing field names and the section prose live here.

Anchor scheme (stable: conformance checks link to ``spec/PROTOCOL.md#<anchor>``):

* ``framing``, ``rpc_tensor``, ``enum-commands``, ``enum-types``, ``blocks`` (and ``block-<type>``, e.g.
  ``block-q4_0``), ``enum-ops``, ``enum-unary``, ``enum-glu``, ``enum-flags``;
* one per version: ``v6``, ``v7``, ``v7-0-1`` (:func:`version_slug`: the major alone when minor and patch are 0,
  otherwise the dotted version with dashes);
* one per command of a version: ``<version slug>-<command name in lower case>``, e.g. ``v7-set_tensor``,
  ``v7-0-1-get_device_supports_op`` (:func:`command_anchor`);
* the cache rule of a version: ``<version slug>-cache-rule`` (e.g. ``v6-cache-rule``);
* the generated difference between a version and its parent: ``changes-<parent slug>-<slug>`` (e.g.
  ``changes-v6-v7``, ``changes-v7-v7-0-1``; :func:`changes_anchor`).

Anchors are emitted as ``<a id="..."></a>`` before their heading, so they do not depend on heading text.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from .. import codec
from ..enums import NEVER_ON_WIRE, Command, GluOp, TensorFlag, UnaryOp
from ..facts import hello_reply
from ..messages import NO_REPLY, Payload, Shape
from ..schema_walk import fields
from ..versions import PROTOCOLS, CommandSpec, Protocol
from .markdown_guide import compute_section, failures_section, hash_section, session_section, shapes_section
from .markdown_rows import (
    Offset,
    Row,
    cell,
    hex_bytes,
    markdown_table,
    payload_rows,
    payload_size,
    sentence,
    struct_rows,
)
from .markdown_sections import framing_section, peer_link_section, rpc_tensor_section, rules_section
from .markdown_tables import anchor as _anchor
from .markdown_tables import blocks_section, op_params_section, ops_table, simple_table, types_table

# ---- anchors -----------------------------------------------------------------------------------------------------


def version_slug(protocol: Protocol) -> str:
    """``v6`` / ``v7`` for x.0.0 versions, ``v7-0-1`` otherwise."""
    major, minor, patch = protocol.version
    return f"v{major}" if (minor, patch) == (0, 0) else f"v{major}-{minor}-{patch}"


def command_anchor(protocol: Protocol, command: Command | int) -> str:
    """Anchor of a command's section in a version, e.g. ``v7-set_tensor``."""
    name = command.name if isinstance(command, Command) else protocol.command_name(command)
    return f"{version_slug(protocol)}-{name.lower()}"


def changes_anchor(protocol: Protocol) -> str:
    """Anchor of the generated section listing what ``protocol`` changes relative to its parent."""
    if protocol.parent is None:
        raise ValueError(f"{protocol.label} has no parent version")
    return f"changes-{version_slug(protocol.parent)}-{version_slug(protocol)}"


# ---- sections ----------------------------------------------------------------------------------------------------


def _reply_text(spec: CommandSpec) -> str:
    if spec.reply is NO_REPLY:
        return "none"
    assert isinstance(spec.reply, Payload)
    if spec.reply.shape is Shape.FIXED:
        return f"{spec.reply.header_size}"
    return " × ".join(f"request.{name}" for name in spec.reply.length_from or ("size",)) + " bytes"


def _request_text(spec: CommandSpec) -> str:
    req = spec.request
    if req.shape is Shape.FIXED:
        return str(req.schema.sizeof())
    if req.shape is Shape.HEADER_DATA:
        return f"{req.schema.sizeof()} + n"
    _, end = struct_rows(req.schema, Offset())
    return str(end)


def _first_defined(protocol: Protocol, command: Command) -> Protocol:
    """The oldest ancestor of ``protocol`` whose spec of ``command`` is the very same object."""
    spec = protocol.commands[command]
    origin = protocol
    p = protocol.parent
    while p is not None and p.commands.get(command) is spec:
        origin, p = p, p.parent
    return origin


def _command_section(protocol: Protocol, spec: CommandSpec, rendered: frozenset[str]) -> str:
    cmd = spec.command
    out = [_anchor(command_anchor(protocol, cmd)), f"### {cmd.name} ({protocol.wire_id(cmd)}) — {protocol.label}\n\n"]
    out.append(sentence(spec.doc))
    origin = _first_defined(protocol, cmd)
    parent = protocol.parent
    if parent is not None:
        if cmd not in parent.commands:
            out.append(f" New in {protocol.label}.")
        elif origin is not protocol:
            out.append(f" Unchanged since {_link(origin, cmd, rendered)}.")
        else:
            out.append(
                f" Changed in {protocol.label} (was {_link(parent, cmd, rendered)}; "
                f"see [changes](#{changes_anchor(protocol)}))."
            )
    out.append("\n\n")
    req = spec.request
    out.append(f"**Request** — {req.doc}; {payload_size(req)}:\n\n{markdown_table(payload_rows(req))}\n")
    if spec.reply is NO_REPLY:
        out.append(
            "**No reply**: the server sends nothing back, not even a size header; a client or decoder must not "
            "wait for one.\n\n"
        )
    else:
        assert isinstance(spec.reply, Payload)
        rep = spec.reply
        out.append(f"**Reply** — {rep.doc}; {payload_size(rep, reply=True)}:\n\n{markdown_table(payload_rows(rep))}\n")
    return "".join(out)


def _link(protocol: Protocol, cmd: Command, rendered: frozenset[str]) -> str:
    """A link to a command's section when that version is part of the document, its plain label otherwise."""
    return f"[{protocol.label}](#{command_anchor(protocol, cmd)})" if protocol.label in rendered else protocol.label


def _cache_rule_rows(protocol: Protocol) -> list[tuple[str, str]]:
    rule = protocol.cache_rule
    return [(f.name, repr(getattr(rule, f.name))) for f in dataclasses.fields(rule) if f.name != "doc"]


def _version_section(protocol: Protocol, rendered: frozenset[str]) -> str:
    slug = version_slug(protocol)
    out = [_anchor(slug), f"## Protocol {protocol.label}\n\n"]
    hello = codec.encode_reply(protocol, Command.HELLO, hello_reply(protocol.version))
    # The version bytes are the fields before conn_caps (major, minor, patch, pad).
    hdr = codec.REPLY_HEADER_SIZE
    ver = hdr + sum(f.length for f in itertools.takewhile(lambda f: f.name != "conn_caps",
                                                         fields(protocol.commands[Command.HELLO].reply.schema)))
    out.append(
        f"HELLO reply of a {protocol.label} server (plain TCP), size header then payload: `{hex_bytes(hello[:hdr])}` "
        f"`{hex_bytes(hello[hdr:ver])}` + {len(hello) - ver} zero bytes. "
        f"RPC_CMD_COUNT = {protocol.command_count}; a server closes the connection on any command id not listed "
        "below and on the never-sent sentinel "
        + ", ".join(f"{c.name} = {protocol.wire_id(c)}" for c in sorted(NEVER_ON_WIRE))
        + ".\n\n"
    )
    if protocol.parent is not None:
        out.append(
            f"Derived from {protocol.parent.label}: see [changes {protocol.parent.label} → {protocol.label}]"
            f"(#{changes_anchor(protocol)}).\n\n"
        )
    out.append("| id | command | request payload bytes | reply payload bytes |\n|---|---|---|---|\n")
    for cmd, spec in protocol.commands.items():
        out.append(
            f"| {protocol.wire_id(cmd)} | [{cmd.name}](#{command_anchor(protocol, cmd)}) | {_request_text(spec)} | "
            f"{_reply_text(spec)} |\n"
        )
    out.append("\n")
    out.append(_anchor(f"{slug}-cache-rule"))
    out.append(f"### Cache rule — {protocol.label}\n\n{sentence(protocol.cache_rule.doc)}\n\n")
    out.append("| property | value |\n|---|---|\n")
    out += [f"| `{name}` | `{value}` |\n" for name, value in _cache_rule_rows(protocol)]
    out.append("\n")
    if protocol.graph_cache_max is not None:
        out.append(_anchor(f"{slug}-graph-cache"))
        out.append(f"### Graph cache — {protocol.label}\n\n"
                   f"A GRAPH_COMPUTE with a non-zero `uid` is kept under (device, uid); one with uid 0 is not kept. "
                   f"Before keeping a graph, a device that holds {protocol.graph_cache_max} (GRAPH_CACHE_MAX) drops "
                   "them all; the client counts alike, so both sides forget at the same point of the stream. "
                   "GRAPH_RECOMPUTE names the uid; one never computed (or forgotten) closes the connection. Any "
                   "FREE_BUFFER forgets every kept graph (their uids still count towards the limit). Graphs compute "
                   "asynchronously: every command that reads or writes buffer data waits for them first.\n\n")
    if Command.COMM_INIT in protocol.commands:
        out.append(peer_link_section(protocol.label, version_slug(protocol), lambda c: command_anchor(protocol, c)))
    for spec in protocol.commands.values():
        out.append(_command_section(protocol, spec, rendered))
    return "".join(out)


# ---- generated differences ---------------------------------------------------------------------------------------


def _payload_map(payload: Payload | object) -> dict[str, Row]:
    if not isinstance(payload, Payload):
        return {}
    return {r.name: r for r in payload_rows(payload)}


def _describe_payload(payload: Payload | object, *, reply: bool = False) -> str:
    return payload_size(payload, reply=reply) if isinstance(payload, Payload) else "no reply"


def diff_rows(old: Protocol, new: Protocol) -> list[tuple[str, str, str]]:
    """Every difference between two tables as (what, old, new), computed field by field."""
    out: list[tuple[str, str, str]] = []
    a, b = hello_reply(old.version), hello_reply(new.version)
    for key in a:
        if a[key] != b[key]:
            out.append((f"HELLO reply `{key}`", str(a[key]), str(b[key])))
    if old.command_count != new.command_count:
        out.append(("RPC_CMD_COUNT", str(old.command_count), str(new.command_count)))
    if old.sentinel != new.sentinel:
        out.append(("NONE (client-side sentinel)", f"id {old.sentinel}", f"id {new.sentinel}"))
    for cmd in sorted(set(old.commands) | set(new.commands)):
        if cmd not in new.commands:
            out.append((f"{cmd.name} ({old.wire_id(cmd)})", "defined", "removed (the server closes)"))
            continue
        link = f"[{cmd.name}](#{command_anchor(new, cmd)})"
        if cmd not in old.commands:
            spec = new.commands[cmd]
            out.append((f"{link} ({new.wire_id(cmd)})", "— (the server closes)",
                        f"added: request {_request_text(spec)} bytes, reply {_reply_text(spec)}"))
            continue
        if old.wire_id(cmd) != new.wire_id(cmd):
            out.append((f"{link} id", str(old.wire_id(cmd)), str(new.wire_id(cmd))))
        so, sn = old.commands[cmd], new.commands[cmd]
        if so is sn:
            continue
        for side, po, pn in (("request", so.request, sn.request), ("reply", so.reply, sn.reply)):
            if po is pn:
                continue
            was, now = _describe_payload(po, reply=side == "reply"), _describe_payload(pn, reply=side == "reply")
            if was != now:
                out.append((f"{link} {side} size", was, now))
            out += _field_diff(f"{link} {side}", _payload_map(po), _payload_map(pn))
        if so.doc != sn.doc:
            out.append((f"{link} purpose", so.doc, sn.doc))
    ro, rn = dict(_cache_rule_rows(old)), dict(_cache_rule_rows(new))
    for key in ro:
        if ro[key] != rn[key]:
            out.append((f"[cache rule](#{version_slug(new)}-cache-rule) `{key}`", f"`{ro[key]}`", f"`{rn[key]}`"))
    if old.cache_rule.doc != new.cache_rule.doc:
        out.append((f"[cache rule](#{version_slug(new)}-cache-rule)", old.cache_rule.doc, new.cache_rule.doc))
    return out


def _field_diff(where: str, old: dict[str, Row], new: dict[str, Row]) -> list[tuple[str, str, str]]:
    out = []
    for name in [*old, *(n for n in new if n not in old)]:
        ro, rn = old.get(name), new.get(name)
        if ro is None:
            assert rn is not None
            out.append((f"{where} {name}", "—", f"added at {rn.offset}, size {rn.size}, {rn.type}: {rn.doc}"))
        elif rn is None:
            out.append((f"{where} {name}", f"at {ro.offset}, size {ro.size}, {ro.type}", "removed"))
        else:
            for attr, label in (("offset", "offset"), ("size", "size"), ("type", "type"), ("doc", "description")):
                if getattr(ro, attr) != getattr(rn, attr):
                    out.append((f"{where} {name} {label}", getattr(ro, attr), getattr(rn, attr)))
    return out


def _changes_section(protocol: Protocol) -> str:
    parent = protocol.parent
    assert parent is not None
    out = [_anchor(changes_anchor(protocol)), f"## Changes {parent.label} → {protocol.label}\n\n"]
    if protocol.changes:
        out.append("Stated by the table:\n\n" + "".join(f"- {c}\n" for c in protocol.changes) + "\n")
    rows = diff_rows(parent, protocol)
    out.append("Computed by comparing the two tables field by field:\n\n")
    if not rows:
        out.append("No difference on the wire.\n\n")
        return "".join(out)
    out.append(f"| what | {parent.label} | {protocol.label} |\n|---|---|---|\n")
    out += [f"| {w} | {cell(o)} | {cell(n)} |\n" for w, o, n in rows]
    out.append("\n")
    return "".join(out)


# ---- enums -------------------------------------------------------------------------------------------------------


def _commands_enum(versions: Sequence[Protocol]) -> str:
    out = [_anchor("enum-commands"), "## Commands\n\n"]
    out.append(
        "Per version: the command's id on the wire, then request size / reply size in bytes; `—`: not a command of "
        "that version (the server closes).  Ids belong to a version: 8.0.0 gives 18 and 19 to new commands.\n\n"
    )
    out.append("| name | " + " | ".join(p.label for p in versions) + " |\n")
    out.append("|---|" + "---|" * len(versions) + "\n")
    for cmd in sorted(Command, key=lambda c: (c >= 0x100, c)):
        cells = []
        for p in versions:
            spec = p.commands.get(cmd)
            if cmd in NEVER_ON_WIRE:
                cells.append(f"{p.sentinel}: never on the wire (client-side sentinel; the server closes)")
            elif spec is None:
                cells.append("—")
            else:
                reply = "no reply" if not spec.has_reply else f"reply {_reply_text(spec)}"
                cells.append(f"{p.wire_id(cmd)}: [{_request_text(spec)} / {reply}](#{command_anchor(p, cmd)})")
        out.append(f"| {cmd.name} | " + " | ".join(cells) + " |\n")
    out.append("| RPC_CMD_COUNT | " + " | ".join(str(p.command_count) for p in versions) + " |\n\n")
    return "".join(out)


# ---- document ----------------------------------------------------------------------------------------------------


def render_markdown(versions: Sequence[Protocol] | None = None) -> str:
    """The whole reference for ``versions`` (default: every covered version), as Markdown."""
    versions = list(PROTOCOLS if versions is None else versions)
    if not versions:
        raise ValueError("no protocol version to document")
    labels = ", ".join(p.label for p in versions)
    out = [
        "# ggml RPC protocol reference\n\n",
        "<!-- Generated by `ggml-rpc spec` from the schemas in ggml_rpc.spec: do not edit by hand. -->\n\n",
        f"Versions: {labels}. Offsets and sizes are in bytes; `n·x` means n times the value of field x. "
        "Anchors are stable: `#framing`, `#rpc_tensor`, `#tensor-shape`, `#nbytes`, `#session`, `#compute`, "
        "`#failures`, `#hash`, `#v7` (a version), `#v7-set_tensor` (a command of a version), `#v7-cache-rule`, "
        "`#changes-v6-v7`, `#rules`, `#enum-commands`.\n\n"
        "To implement a client, read [Framing](#framing), [rpc_tensor](#rpc_tensor), [shapes and "
        "nbytes](#tensor-shape), [a session](#session) and [computing a graph](#compute), then the sections of "
        "the commands of the version you speak.\n\n",
        "## Contents\n\n",
        "- [Framing](#framing)\n- [rpc_tensor](#rpc_tensor)\n",
        "- [Tensors: shape, strides and nbytes](#tensor-shape)\n- [A session, from HELLO to a result](#session)\n",
        "- [Computing a graph](#compute)\n- [Failures: how a refusal shows](#failures)\n",
        "- [The hash (FNV-1a, 64-bit)](#hash)\n",
    ]
    for p in versions:
        out.append(f"- [Protocol {p.label}](#{version_slug(p)})\n")
        if p.parent is not None:
            out.append(f"- [Changes {p.parent.label} → {p.label}](#{changes_anchor(p)})\n")
    out.append(
        "- [Rules](#rules) · [Commands](#enum-commands) · [ggml types](#enum-types) · [block layouts](#blocks) · "
        "[ggml ops](#enum-ops) · [op_params](#op-params) · [unary ops](#enum-unary) · [GLU ops](#enum-glu) · "
        "[tensor flags](#enum-flags)\n\n"
    )
    out.append(framing_section())
    out.append(rpc_tensor_section())
    out.append(shapes_section())
    out.append(session_section(lambda c: command_anchor(versions[-1], c)))
    out.append(compute_section(versions, command_anchor))
    out.append(failures_section(versions))
    out.append(hash_section())
    rendered = frozenset(p.label for p in versions)
    for p in versions:
        out.append(_version_section(p, rendered))
        if p.parent is not None:
            out.append(_changes_section(p))
    out.append(rules_section())
    out.append(_commands_enum(versions))
    out.append(types_table())
    out.append(blocks_section())
    out.append(ops_table())
    out.append(op_params_section())
    out.append(simple_table("enum-unary", "Unary ops (op_params[0] of UNARY)", UnaryOp))
    out.append(simple_table("enum-glu", "GLU ops (op_params[0] of GLU)", GluOp))
    out.append(simple_table("enum-flags", "Tensor flags (rpc_tensor.flags, bit mask)", TensorFlag))
    return "".join(out).rstrip("\n") + "\n"
