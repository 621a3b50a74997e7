"""Spec checks on a captured session, offline (``ggml-rpc lint``) or live (the proxy's ``--check``).

What is checked, per connection:

* ``CACHE-FLAG`` (v7 client rule): a SET_TENSOR may carry a non-zero cache_flag only when it directly follows a
  SET_TENSOR_HASH that missed for the same tensor and offset, with a hash that matches the data it sends; and the
  SET_TENSOR that follows such a miss carries the flag.
* ``FRAMING``: a SET_TENSOR that only makes sense in the other version's layout (v6 bytes on a v7 connection or
  the reverse: the cache_flag byte is present or missing).
* ``REPLY-SIZE``: a reply whose size header is not the size its request's reply has.
* ``NO-REPLY``: reply bytes for a command that has no reply (FREE_BUFFER, BUFFER_CLEAR, INIT_TENSOR, ...).
* ``REQUEST``: a request every server refuses whatever its state (invalid type, region past the tensor, ...).
* ``DECODE``: anything else that stops decoding (no HELLO first, unknown command, truncated stream, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ggml_rpc.spec import (
    Command,
    Protocol,
    ProtocolError,
    Reply,
    Request,
    SizeMismatch,
    SpecViolation,
    UnexpectedReply,
    check_request,
    fnv1a64,
    tensor_name,
    tensor_nbytes,
)
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.versions import PROTOCOLS

from .capture import Connection, read_connections
from .decode import DecodedConnection, decode_connection
from .peer_link import decode_with_links

RULES = {
    "CACHE-FLAG": "cache_flag only on the SET_TENSOR that follows a hash miss for the same tensor, offset and data",
    "FRAMING": "SET_TENSOR in the layout of the negotiated version",
    "REPLY-SIZE": "reply size equals the size of the request's reply",
    "NO-REPLY": "no reply to a command that has none",
    "REQUEST": "requests every server accepts whatever its state",
    "DECODE": "a well-formed stream",
}


@dataclass(frozen=True)
class Violation:
    """One broken rule, located in the capture."""

    rule: str
    connection: int
    #: Index of the request concerned (replies are located by their request's index), None when unknown.
    index: int | None
    direction: str  # "client->server" or "server->client"
    command: str | None
    message: str

    def line(self) -> str:
        at = f"message {self.index}" if self.index is not None else "message ?"
        cmd = f" {self.command}" if self.command else ""
        return f"connection {self.connection} {at}{cmd} ({self.direction}) [{self.rule}]: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def shifted_framing_message(protocol: Protocol, other: Protocol) -> str:
    """The FRAMING violation text for :func:`shifted_framing`'s finding (offline and live checks say the same)."""
    return (f"ends one byte short of its tensor in the {protocol.label} layout and fills it exactly in the "
            f"{other.label} one: probably {other.label} framing")


def _same_tensor(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("id", "type", "buffer", "data", "ne", "nb"))


def follows_miss(miss: Mapping[str, Any], fields: Mapping[str, Any]) -> bool:
    """Whether a SET_TENSOR with ``fields`` writes the tensor region a SET_TENSOR_HASH with ``miss`` asked for."""
    return _same_tensor(miss["tensor"], fields["tensor"]) and miss["offset"] == fields["offset"]


class CacheFlagTracker:
    """The v7 client's cache-flag rule over one connection's messages, fed in wire order."""

    def __init__(self, protocol: Protocol, connection: int) -> None:
        self.flag_field = protocol.cache_rule.flag_field
        self.connection = connection
        self._last: tuple[Command, Mapping[str, Any]] | None = None  # previous request
        self._miss: Mapping[str, Any] | None = None  # fields of a SET_TENSOR_HASH that just missed

    @property
    def after_miss(self) -> bool:
        """True right after a SET_TENSOR_HASH miss: the next SET_TENSOR's data must be hashed."""
        return self._miss is not None

    def request(self, command: Command, fields: Mapping[str, Any], index: int,
                data_hash: Callable[[], int]) -> Violation | None:
        """Check one request; ``data_hash`` computes the FNV-1a of a SET_TENSOR's data when needed."""
        miss, self._miss = self._miss, None
        self._last = (command, fields)
        if self.flag_field is None or command is not Command.SET_TENSOR:
            return None
        flag = fields[self.flag_field]
        follows = miss is not None and follows_miss(miss, fields)
        if not flag:
            if follows and miss is not None and data_hash() == miss["hash"]:
                return self._v(index, "the SET_TENSOR after a hash miss for this tensor carries no cache_flag, "
                                      "so the server will not cache it")
            return None
        name = tensor_name(fields["tensor"]["name"]) or f"id={fields['tensor']['id']:#x}"
        if miss is None:
            return self._v(index, f"cache_flag={flag} on {name} without a SET_TENSOR_HASH miss right before it")
        if not follows:
            return self._v(index, f"cache_flag={flag} on {name}, but the hash miss before it was for another "
                                  "tensor or offset")
        got = data_hash()
        if got != miss["hash"]:
            return self._v(index, f"cache_flag={flag} on {name}: data hashes to {got:016x}, the missed hash was "
                                  f"{miss['hash']:016x}")
        return None

    def reply(self, command: Command, fields: Mapping[str, Any]) -> None:
        if command is Command.SET_TENSOR_HASH and self._last is not None \
                and self._last[0] is Command.SET_TENSOR_HASH and fields.get("result") == 0:
            self._miss = self._last[1]

    def _v(self, index: int, message: str) -> Violation:
        return Violation("CACHE-FLAG", self.connection, index, "client->server", "SET_TENSOR", message)


def _fit(protocol: Protocol, head: memoryview, size: int) -> int | None:
    """How far a SET_TENSOR of ``size`` payload bytes, read in ``protocol``'s layout, ends before its tensor's end
    (negative: past it; None: unreadable).  ``head`` holds at least the layout's header."""
    req = protocol.commands[Command.SET_TENSOR].request
    if size < req.header_size or head.nbytes < req.header_size:
        return None
    layout = flat_layout(req.schema)
    fields = layout.unpack(head[: layout.size])
    try:
        nbytes = tensor_nbytes(fields["tensor"])
    except (KeyError, ValueError):
        return None
    return nbytes - (fields["offset"] + size - layout.size)


def _others(protocol: Protocol) -> list[Protocol]:
    mine = protocol.commands[Command.SET_TENSOR].request.schema
    return [p for p in PROTOCOLS if p.commands[Command.SET_TENSOR].request.schema is not mine]


def other_framing(protocol: Protocol, head: memoryview, size: int | None = None) -> Protocol | None:
    """The covered version whose SET_TENSOR layout fits this payload when ``protocol``'s does not.

    ``head`` is the payload or its first bytes (at least the largest header); ``size`` the whole payload's length
    (default: ``head``'s), so bulk data need not be at hand.
    """
    size = head.nbytes if size is None else size
    for other in _others(protocol):
        fit = _fit(other, head, size)
        if fit is not None and fit >= 0:
            return other
    return None


def shifted_framing(protocol: Protocol, head: memoryview, size: int | None = None) -> Protocol | None:
    """A SET_TENSOR that fits ``protocol``'s layout only one byte short of its tensor's end while another version's
    layout fills the tensor exactly: the silent mis-framing (a v6 payload whose first data byte is 0 read as v7)."""
    size = head.nbytes if size is None else size
    if _fit(protocol, head, size) != 1:
        return None
    for other in _others(protocol):
        if _fit(other, head, size) == 0:
            return other
    return None


def _request_violation(dc: DecodedConnection, req: Request, exc: SpecViolation) -> Violation:
    idx = dc.conn.index
    if req.command is Command.SET_TENSOR and dc.protocol is not None:
        other = other_framing(dc.protocol, req.raw)
        if other is not None:
            return Violation("FRAMING", idx, req.index, "client->server", "SET_TENSOR",
                             f"does not fit the {dc.protocol.label} layout but fits the {other.label} one ({exc})")
    return Violation("REQUEST", idx, req.index, "client->server", req.command.name, str(exc))


def _decode_violation(dc: DecodedConnection) -> Violation:
    err = dc.error
    assert err is not None
    idx = dc.conn.index
    if dc.error_direction == "server->client":
        answered = {id(r.request) for r in dc.replies}
        pending = [r for r in dc.requests if id(r) not in answered]
        waiting = [r for r in pending if dc.protocol is not None and dc.protocol.spec(r.command) is not None
                   and dc.protocol.spec(r.command).has_reply]  # type: ignore[union-attr]
        req = waiting[0] if waiting else None
        index = req.index if req is not None else None
        cmd = req.command.name if req is not None else err.command
        if isinstance(err, UnexpectedReply):
            return Violation("NO-REPLY", idx, index, "server->client", cmd,
                             f"reply bytes after the last request that has a reply ({err})")
        if isinstance(err, SizeMismatch) and req is not None:
            before = [r for r in pending if r.index < req.index and r not in waiting]
            if before and "reply size 0," in err.message:
                silent = before[-1]
                return Violation("NO-REPLY", idx, silent.index, "server->client", silent.command.name,
                                 f"an empty reply where none is due: {silent.command.name} has no reply in "
                                 f"{dc.protocol.label if dc.protocol else '?'} ({err})")
            return Violation("REPLY-SIZE", idx, index, "server->client", cmd, str(err))
        return Violation("DECODE", idx, index, "server->client", cmd, str(err))
    index = len(dc.requests)
    return Violation("DECODE", idx, index, "client->server", err.command, str(err))


def lint_connection(dc: DecodedConnection) -> list[Violation]:
    """Every violation of one decoded connection (decode with ``validate=False``: content is checked here)."""
    out: list[Violation] = []
    tracker = CacheFlagTracker(dc.protocol, dc.conn.index) if dc.protocol is not None else None
    for msg in dc.messages():
        if isinstance(msg, Reply):
            if tracker is not None:
                tracker.reply(msg.command, msg.fields)
            continue
        try:
            check_request(msg)
        except SpecViolation as exc:
            out.append(_request_violation(dc, msg, exc))
            continue
        if msg.command is Command.SET_TENSOR and dc.protocol is not None:
            other = shifted_framing(dc.protocol, msg.raw)
            if other is not None:
                out.append(Violation("FRAMING", dc.conn.index, msg.index, "client->server", "SET_TENSOR",
                                     shifted_framing_message(dc.protocol, other)))
                continue
        if tracker is not None:
            data = msg.data
            v = tracker.request(msg.command, msg.fields, msg.index,
                                lambda d=data: fnv1a64(d) if d is not None else fnv1a64(b""))
            if v is not None:
                out.append(v)
    if dc.error is not None:
        out.append(_decode_violation(dc))
    return out


def lint_connections(conns: Iterable[Connection], protocol: Protocol | None = None) -> list[Violation]:
    """Every violation in these connections of a capture, connection by connection."""
    out: list[Violation] = []
    for dc in decode_with_links(list(conns), lambda c: decode_connection(c, protocol, validate=False)):
        out.extend(lint_connection(dc))
    return out


def lint_file(path: str | Path, protocol: Protocol | None = None, *, port: int | None = None) -> list[Violation]:
    """Every violation in a capture, connection by connection."""
    return lint_connections(read_connections(path, port=port), protocol)


def summarize(violations: Iterable[Violation]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in violations:
        counts[v.rule] = counts.get(v.rule, 0) + 1
    return counts


__all__ = ["RULES", "CacheFlagTracker", "ProtocolError", "Violation", "follows_miss", "lint_connection",
           "lint_connections", "lint_file", "other_framing", "shifted_framing", "shifted_framing_message", "summarize"]
