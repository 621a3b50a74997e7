"""The protocol's content rules, one table: rule id -> level, side, text, and a predicate.

What a rule may know:

1. One decoded request (:class:`Message`): its command, fields, index and stream offset, the payload size its
   header claims, how many bulk data bytes it carries (counted, not kept), its first bytes (the fixed part and the
   start of a SET_TENSOR's data, enough for the framing rules), and the FNV-1a of its data when
   :func:`wants_data_hash` asked for it before the data streamed past.
2. A small connection state (:class:`ConnState`): the negotiated version and whether the request right before
   was a SET_TENSOR_HASH that missed (with its fields).  Every reply before the request has been applied to it.

What a rule must not know: sockets, threads, captures, whole bulk payloads, or the server's state (buffers,
allocations, stored graphs).  Rules that need the server's state are the reference server's refusals and the
conformance checks; rules that need the framing itself (sizes, command ids, reply pairing) are the framer's
(:mod:`.framing`) and appear here as entries without a predicate, so that every reported id comes from this table.

The conditions a predicate shares with the reference server's refusals (a type that is not ggml's, a region past
its tensor, the rows' span, the graph's node ids) live in :mod:`.conditions`, so each is written once.

A message breaks at most one rule: the first of the table, in table order, whose predicate finds something.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from . import conditions
from .conditions import region_2d_span
from .enums import GGML_TYPE_COUNT, TYPES, Command
from .facts import ggml_nbytes
from .layout_fit import other_framing, shifted_framing
from .tensor import tensor_name
from .versions import Protocol

C = Command


class Level(StrEnum):
    MUST = "MUST"
    SHOULD = "SHOULD"


class Side(StrEnum):
    CLIENT = "client"
    SERVER = "server"


@dataclass(frozen=True, slots=True)
class Message:
    """A request as a rule sees it (built from a codec Request or from a streaming framer's Head)."""

    command: Command
    fields: Mapping[str, Any]
    index: int
    #: Stream offset of the command byte.
    offset: int
    #: Payload bytes the size header claims.
    size: int
    #: Bulk data bytes (SET_TENSOR / SET_TENSOR_2D data): counted, not kept.
    data_len: int = 0
    #: The payload's first bytes: the fixed part, and for a SET_TENSOR at least the longest header of any version.
    head: memoryview = field(default_factory=lambda: memoryview(b""))
    #: FNV-1a of the data, when :func:`wants_data_hash` asked for it (None: not computed, or the data never came).
    data_hash: int | None = None


@dataclass
class ConnState:
    """What a connection has said before the request being checked."""

    protocol: Protocol | None = None
    #: Fields of the SET_TENSOR_HASH right before, when its reply said miss.
    miss: Mapping[str, Any] | None = None
    _last: tuple[Command, Mapping[str, Any]] | None = None

    def requested(self, msg: Message) -> None:
        """The request was checked: it is now "the request before" the next one."""
        self.miss = None
        self._last = (msg.command, msg.fields)

    def replied(self, command: Command, fields: Mapping[str, Any]) -> None:
        """The reply to the latest checked request arrived."""
        last = self._last
        if command is C.SET_TENSOR_HASH and last is not None and last[0] is C.SET_TENSOR_HASH \
                and fields.get("result") == 0:
            self.miss = last[1]


@dataclass(frozen=True, slots=True)
class Finding:
    text: str
    #: The field the finding is about (dotted, with [i] for arrays), for locating it in the payload.
    field: str


Predicate = Callable[[Message, ConnState], Finding | None]


@dataclass(frozen=True)
class Rule:
    id: str
    level: Level
    side: Side
    text: str
    #: Requests the predicate reads; empty for rules the framer enforces (no predicate).
    commands: frozenset[Command] = frozenset()
    check: Predicate | None = None
    #: Holds whatever the connection said before (the codec's validating decoder applies these alone).
    stateless: bool = True


# ---- the data the predicates (and the Lua dissector) read --------------------------------------------------------

#: Tensor fields of each request whose type must be a ggml type that still exists.
TENSOR_FIELDS: dict[Command, tuple[str, ...]] = {
    C.SET_TENSOR: ("tensor",), C.GET_TENSOR: ("tensor",), C.MEMSET_TENSOR: ("tensor",),
    C.SET_TENSOR_2D: ("tensor",), C.GET_TENSOR_2D: ("tensor",), C.INIT_TENSOR: ("tensor",),
    C.COMM_ALLREDUCE: ("tensor",), C.COPY_TENSOR: ("src", "dst"),
}
#: Requests naming one region ``offset .. offset + n`` of their tensor: where n comes from (None: the data length).
REGION_LENGTH: dict[Command, str | None] = {C.SET_TENSOR: None, C.GET_TENSOR: "size", C.MEMSET_TENSOR: "size"}
#: Requests naming rows of their tensor (size, n_copies, stride from offset); True: the rows follow as data.
ROWS: dict[Command, bool] = {C.SET_TENSOR_2D: True, C.GET_TENSOR_2D: False}
#: Copies: (source field, destination field).
COPIES: dict[Command, tuple[str, str]] = {C.COPY_TENSOR: ("src", "dst")}


def _nbytes(t: Mapping[str, Any]) -> int | None:
    """Bytes of a tensor, None when its type is not a live ggml type (another rule reports that)."""
    if conditions.unknown_type(t["type"]) or conditions.removed_type(t["type"]):
        return None
    return ggml_nbytes(t["type"], t["ne"], t["nb"])


def _type(msg: Message, _s: ConnState) -> Finding | None:
    if msg.command is C.GRAPH_COMPUTE:
        types = msg.fields["tensors"]["type"]
        bad = np.flatnonzero(conditions.unknown_types(types))
        if len(bad):
            i = int(bad[0])
            return Finding(f"tensor {i} has type {int(types[i])}", f"tensors[{i}].type")
        return None
    for name in TENSOR_FIELDS[msg.command]:
        t = msg.fields[name]["type"]
        if conditions.unknown_type(t):
            return Finding(f"type {t} is not a ggml type (< {GGML_TYPE_COUNT})", f"{name}.type")
    return None


def _removed(msg: Message, _s: ConnState) -> Finding | None:
    for name in TENSOR_FIELDS[msg.command]:
        t = msg.fields[name]["type"]
        if conditions.removed_type(t):
            return Finding(f"type {t} ({TYPES[t].name}) was removed from ggml", f"{name}.type")
    return None


def _region(msg: Message) -> tuple[int, int, int] | None:
    """(offset, n, tensor bytes) of a region request, None when its tensor has no size."""
    f = msg.fields
    length = REGION_LENGTH[msg.command]
    nbytes = _nbytes(f["tensor"])
    if nbytes is None:
        return None
    return f["offset"], (msg.data_len if length is None else f[length]), nbytes


def _past(msg: Message, _s: ConnState) -> Finding | None:
    r = _region(msg)
    if r is None or not conditions.region_past(*r):
        return None
    return Finding(f"region offset {r[0]} + {r[1]} bytes runs past the tensor's {r[2]} bytes", "offset")


def _copy(msg: Message, _s: ConnState) -> Finding | None:
    src_f, dst_f = COPIES[msg.command]
    src, dst = _nbytes(msg.fields[src_f]), _nbytes(msg.fields[dst_f])
    if src is not None and dst is not None and src > dst:
        return Finding(f"copies {src} bytes into a {dst}-byte tensor", dst_f)
    return None


def _no_nodes(msg: Message, _s: ConnState) -> Finding | None:
    return Finding("a graph without nodes", "n_nodes") if msg.fields["n_nodes"] == 0 else None


def _null_node(msg: Message, _s: ConnState) -> Finding | None:
    return Finding("node id 0 (a null node)", "nodes") if np.any(conditions.null_nodes(msg.fields["nodes"])) else None


def _unknown_node(msg: Message, _s: ConnState) -> Finding | None:
    nodes = msg.fields["nodes"]
    unknown = np.flatnonzero(conditions.first_rows(msg.fields["tensors"]["id"], nodes) < 0)
    if not len(unknown):
        return None
    i = int(unknown[0])
    return Finding(f"node id {int(nodes[i]):#x} is not among the tensors", f"nodes[{i}]")


def _rows_zero(msg: Message, _s: ConnState) -> Finding | None:
    f = msg.fields
    if not conditions.rows_zero(f["size"], f["n_copies"]):
        return None
    name = "size" if f["size"] == 0 else "n_copies"
    return Finding(f"{name} is 0", name)


def _rows_data(msg: Message, _s: ConnState) -> Finding | None:
    f = msg.fields
    if not ROWS[msg.command] or not conditions.rows_data_mismatch(f["size"], f["n_copies"], msg.data_len):
        return None
    return Finding(f"{msg.data_len} data bytes, but size {f['size']} x n_copies {f['n_copies']} = "
                   f"{f['size'] * f['n_copies']}", "size")


def _rows_text(f: Mapping[str, Any], what: str) -> str:
    return f"rows at offset {f['offset']}, {f['n_copies']} x {f['size']} bytes, stride {f['stride']}: {what}"


def _rows_overflow(msg: Message, _s: ConnState) -> Finding | None:
    f = msg.fields
    if region_2d_span(f["size"], f["n_copies"], f["stride"]) is None:
        return Finding(_rows_text(f, "overflows 64 bits"), "stride")
    return None


def _rows_past(msg: Message, _s: ConnState) -> Finding | None:
    f = msg.fields
    span, nbytes = region_2d_span(f["size"], f["n_copies"], f["stride"]), _nbytes(f["tensor"])
    if span is None or nbytes is None or not conditions.region_past(f["offset"], span, nbytes):
        return None
    return Finding(_rows_text(f, f"runs past the tensor's {nbytes} bytes"), "stride")


# ---- framing: a SET_TENSOR in another version's layout (which layout fits: :mod:`.layout_fit`) ---------------


def _layout_fit(msg: Message, s: ConnState, applies: Callable[[int, int, int], bool],
                fits: Callable[[Protocol, memoryview, int], Protocol | None]) -> tuple[Protocol, Protocol] | None:
    """(negotiated, other) version when the region (offset, n, nbytes) is in the case ``applies`` names and ``fits``
    finds another version's layout for the payload."""
    r = _region(msg)
    if s.protocol is None or r is None or not r[1] or not applies(*r):
        return None
    other = fits(s.protocol, msg.head, msg.size)
    return None if other is None else (s.protocol, other)


def _other_layout(msg: Message, s: ConnState) -> Finding | None:
    found = _layout_fit(msg, s, lambda off, n, nbytes: off + n > nbytes, other_framing)
    if found is None:
        return None
    off, n, nbytes = _region(msg) or (0, 0, 0)
    return Finding(f"does not fit the {found[0].label} layout but fits the {found[1].label} one (region offset "
                   f"{off} + {n} bytes runs past the tensor's {nbytes} bytes)", "offset")


def _shifted(msg: Message, s: ConnState) -> Finding | None:
    found = _layout_fit(msg, s, lambda off, n, nbytes: off + n == nbytes - 1, shifted_framing)
    if found is None:
        return None
    return Finding(f"ends one byte short of its tensor in the {found[0].label} layout and fills it exactly in "
                   f"the {found[1].label} one: probably {found[1].label} framing", "offset")


# ---- the cache flag (7.0.0 on) -------------------------------------------------------------------------------------


def follows_miss(miss: Mapping[str, Any], fields: Mapping[str, Any]) -> bool:
    """Whether a SET_TENSOR with ``fields`` writes the tensor region a SET_TENSOR_HASH with ``miss`` asked for."""
    a, b = miss["tensor"], fields["tensor"]
    return all(a[k] == b[k] for k in ("id", "type", "buffer", "data", "ne", "nb")) \
        and miss["offset"] == fields["offset"]


def wants_data_hash(protocol: Protocol | None, command: Command, fields: Mapping[str, Any],
                    previous: Command | None) -> bool:
    """Whether the cache-flag rules will need this request's data hashed: decided from its head, before the data
    streams past (a flagged SET_TENSOR, or any SET_TENSOR right after a SET_TENSOR_HASH, whose reply may still be
    on its way)."""
    flag = protocol.cache_rule.flag_field if protocol is not None else None
    return command is C.SET_TENSOR and flag is not None and bool(fields.get(flag) or previous is C.SET_TENSOR_HASH)


def _flag(msg: Message, s: ConnState) -> int:
    name = s.protocol.cache_rule.flag_field if s.protocol is not None else None
    return msg.fields.get(name, 0) if name else 0


def _label(msg: Message) -> str:
    t = msg.fields["tensor"]
    return tensor_name(t["name"]) or f"id={t['id']:#x}"


def _flag_no_miss(msg: Message, s: ConnState) -> Finding | None:
    if (flag := _flag(msg, s)) and s.miss is None:
        return Finding(f"cache_flag={flag} on {_label(msg)} without a SET_TENSOR_HASH miss right before it",
                       "cache_flag")
    return None


def _flag_other_region(msg: Message, s: ConnState) -> Finding | None:
    if (flag := _flag(msg, s)) and s.miss is not None and not follows_miss(s.miss, msg.fields):
        return Finding(f"cache_flag={flag} on {_label(msg)}, but the hash miss before it was for another tensor or "
                       "offset", "cache_flag")
    return None


def _flag_hash(msg: Message, s: ConnState) -> Finding | None:
    if not (flag := _flag(msg, s)) or s.miss is None or msg.data_hash is None or msg.data_hash == s.miss["hash"]:
        return None
    return Finding(f"cache_flag={flag} on {_label(msg)}: data hashes to {msg.data_hash:016x}, the missed hash was "
                   f"{s.miss['hash']:016x}", "cache_flag")


def _flag_missing(msg: Message, s: ConnState) -> Finding | None:
    if s.protocol is None or s.protocol.cache_rule.flag_field is None or _flag(msg, s) or s.miss is None:
        return None
    if follows_miss(s.miss, msg.fields) and msg.data_hash == s.miss["hash"]:
        return Finding("the SET_TENSOR after a hash miss for this tensor carries no cache_flag, so the server will "
                       "not cache it", "cache_flag")
    return None


# ---- the table ------------------------------------------------------------------------------------------------------

_CL, _SV, MUST, SHOULD = Side.CLIENT, Side.SERVER, Level.MUST, Level.SHOULD
_GRAPH, _SET = frozenset({C.GRAPH_COMPUTE}), frozenset({C.SET_TENSOR})

RULES: tuple[Rule, ...] = (
    Rule("TENSOR-TYPE", MUST, _CL, "every tensor of a request has a ggml type id (below the type count)",
         frozenset(TENSOR_FIELDS) | _GRAPH, _type),
    Rule("TENSOR-REMOVED-TYPE", MUST, _CL, "no tensor of a request has a type removed from ggml",
         frozenset(TENSOR_FIELDS), _removed),
    Rule("FRAMING-OTHER-LAYOUT", MUST, _CL, "a SET_TENSOR is in the negotiated version's layout (not one that "
         "runs past its tensor here and fits in another version's)", _SET, _other_layout, stateless=False),
    Rule("REGION-PAST-TENSOR", MUST, _CL, "a SET_TENSOR, GET_TENSOR or MEMSET_TENSOR region (offset + bytes) lies "
         "inside its tensor's nbytes", frozenset(REGION_LENGTH), _past),
    Rule("FRAMING-SHIFTED", MUST, _CL, "a SET_TENSOR does not end one byte short of its tensor where another "
         "version's layout fills it exactly (the silent one-byte shift)", _SET, _shifted, stateless=False),
    Rule("COPY-FITS-DST", MUST, _CL, "COPY_TENSOR copies no more bytes (nbytes of src) than its dst holds (nbytes)",
         frozenset(COPIES), _copy),
    Rule("GRAPH-NO-NODES", MUST, _CL, "a GRAPH_COMPUTE graph has at least one node", _GRAPH, _no_nodes),
    Rule("GRAPH-NULL-NODE", MUST, _CL, "no graph node id is 0", _GRAPH, _null_node),
    Rule("GRAPH-NODE-UNKNOWN", MUST, _CL, "every graph node id is among the graph's tensors", _GRAPH, _unknown_node),
    Rule("ROWS-ZERO", MUST, _CL, "SET_TENSOR_2D / GET_TENSOR_2D rows have a non-zero size and n_copies",
         frozenset(ROWS), _rows_zero),
    Rule("ROWS-DATA-LENGTH", MUST, _CL, "SET_TENSOR_2D carries exactly size x n_copies data bytes",
         frozenset(c for c, data in ROWS.items() if data), _rows_data),
    Rule("ROWS-SPAN-OVERFLOW", MUST, _CL, "the rows' span (n_copies - 1) x stride + size fits 64 bits",
         frozenset(ROWS), _rows_overflow),
    Rule("ROWS-PAST-TENSOR", MUST, _CL, "the rows' span from offset lies inside the tensor's nbytes",
         frozenset(ROWS), _rows_past),
    Rule("CACHE-FLAG-NO-MISS", MUST, _CL, "cache_flag is set only on the SET_TENSOR right after a SET_TENSOR_HASH "
         "miss", _SET, _flag_no_miss, stateless=False),
    Rule("CACHE-FLAG-OTHER-REGION", MUST, _CL, "a flagged SET_TENSOR writes the tensor and offset the hash miss "
         "before it named", _SET, _flag_other_region, stateless=False),
    Rule("CACHE-FLAG-HASH", MUST, _CL, "a flagged SET_TENSOR's data hashes (FNV-1a) to the hash that missed",
         _SET, _flag_hash, stateless=False),
    Rule("CACHE-FLAG-MISSING", SHOULD, _CL, "the SET_TENSOR that sends the data of a hash miss carries cache_flag "
         "(else the server does not cache it)", _SET, _flag_missing, stateless=False),
    Rule("DECODE", MUST, _CL, "a well-formed request stream: HELLO first and once, commands of the version, sizes "
         "the command allows, fixed parts its layout decodes", stateless=False),
    Rule("REPLY-DECODE", MUST, _SV, "a well-formed reply stream: a HELLO reply naming a covered version, replies "
         "the version's layouts decode", stateless=False),
    Rule("REPLY-SIZE", MUST, _SV, "a reply's size header equals the size of its request's reply", stateless=False),
    Rule("NO-REPLY", MUST, _SV, "no reply bytes for a command that has no reply", stateless=False),
    Rule("LINK-BYTES", MUST, _SV, "the servers' link (8.0.0) carries each side's caps, then one tensor copy each "
         "way per COMM_ALLREDUCE of the rank-0 client (a connection to its port that carries no byte either way is "
         "a connect dropped before the link, not the link)", stateless=False),
)

BY_ID: dict[str, Rule] = {r.id: r for r in RULES}
_BY_COMMAND: dict[Command, tuple[Rule, ...]] = {
    c: tuple(r for r in RULES if c in r.commands and r.check is not None) for c in Command}
_STATELESS = {c: tuple(r for r in rules if r.stateless) for c, rules in _BY_COMMAND.items()}


def first_broken(msg: Message, state: ConnState, *, stateless_only: bool = False) -> tuple[Rule, Finding] | None:
    """The first rule of the table this request breaks, with what was found (None: it breaks none)."""
    for rule in (_STATELESS if stateless_only else _BY_COMMAND)[msg.command]:
        assert rule.check is not None
        found = rule.check(msg, state)
        if found is not None:
            return rule, found
    return None


__all__ = ["BY_ID", "COPIES", "REGION_LENGTH", "ROWS", "RULES", "TENSOR_FIELDS", "ConnState", "Finding", "Level",
           "Message", "Rule", "Side", "first_broken", "follows_miss", "other_framing", "region_2d_span",
           "shifted_framing", "wants_data_hash"]
