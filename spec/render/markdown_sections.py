"""Sections of the protocol reference that are not a command's layout: the framing, rpc_tensor, the rule table and
the 8.0.0 servers' link (see :mod:`~ggml_rpc.spec.render.markdown`, which places them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..enums import Command
from ..facts import COMM_BF16_FROM_ELEMENTS, CONN_CAPS_SIZE
from ..payloads import REPLY_HEADER, REQUEST_HEADER
from ..rules import RULES
from ..schema_walk import int_label
from ..tensor import RpcTensor
from .markdown_rows import Offset, Row, linked, markdown_table, struct_rows
from .markdown_tables import anchor

#: Framing: the field names and meanings of the codec's header formats (sizes and types come from the codec).  The
#: header's length is named ``payload_size`` here, apart from the payload fields called ``size`` (GET_TENSOR's bytes
#: to read, SET_TENSOR_2D's bytes per row...), which are another thing.
_REQUEST_FRAMING = (
    ("cmd", "command id (see [commands](#enum-commands))"),
    ("payload_size", "number of payload bytes that follow (the size header)"),
)
_REPLY_FRAMING = (("payload_size", "number of payload bytes that follow (the size header)"),)
_FRAMING_PAYLOAD = {"Request": "the request payload: the command's request layout, exactly payload_size bytes",
                    "Reply": "the reply payload: the command's reply layout, exactly payload_size bytes"}

#: Where the rpc_tensor table sends a reader for what a field's one line cannot say.
_RPC_TENSOR_SEE = {
    "id": ("computing a graph", "compute"),
    "type": ("ggml types", "enum-types"),
    "buffer": ("a session", "session"),
    "ne": ("shapes", "tensor-shape"),
    "nb": ("shapes", "tensor-shape"),
    "op": ("ggml ops", "enum-ops"),
    "flags": ("computing a graph", "compute"),
    "src": ("computing a graph", "compute"),
    "data": ("alignment", "alignment"),
    "use_count": ("computing a graph", "compute"),
}


def framing_section() -> str:
    """``#framing``: the request and reply headers, from the codec's header formats."""
    out = [anchor("framing"), "## Framing\n\n"]
    out.append(
        "One TCP stream per connection. All integers are little-endian and structures are packed. A request is a "
        "header followed by its payload; a reply (only for commands that have one) is a size header followed by "
        "its payload. Replies carry no command id: they answer the requests that expect one, in order. The first "
        "request of a connection must be HELLO, and HELLO is sent only once. The size header is called "
        "`payload_size` below, to keep it apart from payload fields named `size`.\n\n"
    )
    for title, fmt, names in (
        ("Request", REQUEST_HEADER, _REQUEST_FRAMING),
        ("Reply", REPLY_HEADER, _REPLY_FRAMING),
    ):
        chars = fmt.format.lstrip("<")
        if len(chars) != len(names):
            raise AssertionError(f"framing names do not match the codec's {title.lower()} header {fmt.format!r}")
        rows, off = [], 0
        for ch, (name, doc) in zip(chars, names, strict=True):
            size = fmt.__class__("<" + ch).size
            rows.append(Row(str(off), str(size), int_label(ch), f"`{name}`", doc))
            off += size
        rows.append(Row(str(off), "payload_size", "bytes", "`payload`", _FRAMING_PAYLOAD[title]))
        out.append(f"**{title}** ({fmt.size}-byte header):\n\n{markdown_table(rows)}\n")
    return "".join(out)


def rpc_tensor_section() -> str:
    """``#rpc_tensor``: the tensor description's fields, each pointing where its one line cannot say enough."""
    rows, end = struct_rows(RpcTensor, Offset())
    rows = [dataclasses.replace(r, doc=f"{r.doc} (see [{see[0]}](#{see[1]}))") if (see := _RPC_TENSOR_SEE.get(
        r.name.strip("`"))) else r for r in rows]
    return (
        anchor("rpc_tensor")
        + f"## rpc_tensor ({end} bytes)\n\n"
        + f"{RpcTensor.__doc__ or ''} Identical in every covered version.\n\n"
        + markdown_table(rows)
        + "\n"
    )



def rules_section() -> str:
    """The rule table of :mod:`~ggml_rpc.spec.rules`: what ``ggml-rpc lint`` and ``proxy --check`` report."""
    out = [anchor("rules"), "## Rules\n\n"]
    out.append(
        "The protocol's content rules, from the one table `ggml_rpc.spec.rules` (the ids `ggml-rpc lint` and "
        "`ggml-rpc proxy --check` report). A message breaks at most one: the first of this table, in this order. "
        "Rules without requests are the framer's (sizes, command ids, reply pairing).\n\n"
        "| id | level | binds | rule | requests |\n|---|---|---|---|---|\n"
    )
    for r in RULES:
        cmds = ", ".join(sorted(c.name for c in r.commands)) or "(framing)"
        out.append(f"| `{r.id}` | {r.level.value} | {r.side.value} | {linked(r.text)} | {cmds} |\n")
    return "".join(out) + "\n"


def peer_link_section(label: str, slug: str, command_anchor: Callable[[Command], str]) -> str:
    """The servers' own link that COMM_INIT opens: not a client message, so described here from the facts."""
    link = [anchor(f"{slug}-peer-link"), f"### The servers' link — {label}\n\n"]
    link.append(
        f"[COMM_INIT](#{command_anchor(Command.COMM_INIT)}) makes two servers open a TCP connection of their "
        "own: rank 0 listens on `port`, rank 1 connects to `host:port` (retrying for about five seconds; genuine "
        "clients pick the rank-0 server's RPC port + 1000). The link carries no headers and no command bytes:\n\n"
        f"1. the connector (rank 1) sends its {CONN_CAPS_SIZE} caps bytes, then rank 0 answers with its own "
        "(all zero over plain TCP, as in HELLO);\n"
        f"2. for every [COMM_ALLREDUCE](#{command_anchor(Command.COMM_ALLREDUCE)}) (the client sends one "
        "to each rank for the same tensor), rank 0 sends its copy of the tensor and then receives rank 1's, rank 1 "
        "receives first and then sends (so large tensors cannot deadlock). An F32 tensor of "
        f"{COMM_BF16_FROM_ELEMENTS:,} elements or more travels as BF16 (rounded to nearest even), any other as its "
        "`nbytes`; a tensor of no bytes sends nothing;\n"
        "3. each rank adds the copy it received to its own tensor, in place (with BF16 on the link, the two ranks' "
        "sums differ in the last bits); [COMM_FREE](#"
        f"{command_anchor(Command.COMM_FREE)}) closes the link.\n\n"
        "A capture of both servers' client connections therefore decodes the link exchange by exchange, from the "
        "rank-0 connection's COMM_ALLREDUCE sequence. Only `world` = 2 is served: any other COMM_INIT answers "
        "`ok` = 0 and the connection goes on; a device already in a communicator answers 1 again.\n\n"
    )
    return "".join(link)
