"""Sections of the protocol reference that are not a command's layout: the rule table and the 8.0.0 servers' link
(see :mod:`~ggml_rpc.spec.render.markdown`, which places them)."""

from __future__ import annotations

from collections.abc import Callable

from ..enums import Command
from ..facts import COMM_BF16_FROM_ELEMENTS, CONN_CAPS_SIZE
from ..rules import RULES
from .markdown_rows import linked
from .markdown_tables import anchor


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
