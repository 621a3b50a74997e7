"""One table per protocol version.

Version 6.0.0 is the full table.  Every later version is derived from its predecessor and states only what it
changes (a replaced layout, an added command, a different cache rule), so protocol 8 is one more ``derive``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import messages as m
from .enums import NEVER_ON_WIRE, Command, command_name
from .facts import GRAPH_CACHE_MAX, HASH_THRESHOLD


@dataclass(frozen=True)
class CommandSpec:
    """A command of one version: its request payload and its reply (or :data:`NO_REPLY`)."""

    command: Command
    request: m.Payload
    reply: m.Payload | m._NoReply
    doc: str

    @property
    def has_reply(self) -> bool:
        return self.reply is not m.NO_REPLY

    def reply_size(self, request_fields: Mapping[str, Any]) -> int:
        """Payload bytes of the reply to a request with these fields: a RAW reply is as long as the request fields
        its payload names say (GET_TENSOR's ``size``), any other is its layout's fixed size.  Raises for no-reply."""
        reply = self.reply
        if not isinstance(reply, m.Payload):
            raise ValueError(f"{self.command.name} has no reply")
        if reply.shape is m.Shape.RAW:
            return reply.reply_length(dict(request_fields))
        return reply.header_size


@dataclass(frozen=True)
class CacheRule:
    """When a server with a cache directory saves a SET_TENSOR payload, and how a client uses the hash path."""

    #: v7+: request field whose non-zero value asks for a save; None: no flag (v6).
    flag_field: str | None
    #: v6: payloads strictly larger than this are saved; None: no server-side size threshold.
    save_above: int | None
    #: Client: only transfers strictly larger than this go through SET_TENSOR_HASH first.
    client_hash_above: int
    #: Client: True when only tensors of weight buffers take the hash path (v7).
    client_weights_only: bool
    doc: str

    def server_saves(self, payload_len: int, cache_flag: int = 0) -> bool:
        """Does a server with a cache directory save this SET_TENSOR payload?"""
        if self.flag_field is not None:
            return cache_flag != 0
        return self.save_above is not None and payload_len > self.save_above


SIZE_RULE = CacheRule(
    flag_field=None,
    save_above=HASH_THRESHOLD,
    client_hash_above=HASH_THRESHOLD,
    client_weights_only=False,
    doc="the server saves every SET_TENSOR payload larger than 10 MiB, whatever the tensor is; the client sends "
    "SET_TENSOR_HASH before every transfer larger than 10 MiB",
)
FLAG_RULE = CacheRule(
    flag_field="cache_flag",
    save_above=None,
    client_hash_above=HASH_THRESHOLD,
    client_weights_only=True,
    doc="the server saves a SET_TENSOR payload only when cache_flag != 0, at any size; the client hashes only "
    "weight-buffer transfers larger than 10 MiB and sets cache_flag = 1 only on the SET_TENSOR that follows a "
    "SET_TENSOR_HASH miss",
)


#: Wire ids of 6.0.0 to 7.0.1: each command's id is its Command value (NONE, the client's sentinel, at 18).
_CLASSIC_IDS: Mapping[Command, int] = MappingProxyType({c: int(c) for c in Command if int(c) < 0x100})


@dataclass(frozen=True)
class Protocol:
    """The complete command table of one protocol version."""

    version: tuple[int, int, int]
    commands: Mapping[Command, CommandSpec]
    cache_rule: CacheRule
    parent: Protocol | None = None
    #: What this version changes relative to ``parent`` (prose, for the generated docs).
    changes: tuple[str, ...] = field(default=())
    #: Wire id of every command of this version, and of the NONE sentinel.
    ids: Mapping[Command, int] = field(default_factory=lambda: _CLASSIC_IDS)
    #: 8.0.0: graphs are kept per (device, uid), at most this many per device (then the device's cache is emptied);
    #: None: one graph per device, the last computed (6.0.0, 7.0.x).
    graph_cache_max: int | None = None

    def __post_init__(self) -> None:
        by_id: dict[int, Command] = {}
        for cmd in (*self.commands, Command.NONE):
            wire = self.ids[cmd]
            if wire in by_id or not 0 <= wire < 256:
                raise ValueError(f"protocol {self.label}: {cmd.name} has wire id {wire}, which is taken or no byte")
            by_id[wire] = cmd
        object.__setattr__(self, "_by_id", MappingProxyType(by_id))

    def wire_id(self, command: Command) -> int:
        """The byte this version sends for ``command`` (KeyError when the version does not have it)."""
        if command in self.commands or command is Command.NONE:
            return self.ids[command]
        raise KeyError(f"{command.name} is not a command of protocol {self.label}")

    def command_at(self, wire: int) -> Command | None:
        """The command a request byte names in this version (NONE for the sentinel), or None."""
        return self._by_id.get(wire)  # type: ignore[attr-defined]

    def command_name(self, wire: int) -> str:
        """Name of a wire id in this version; an id it does not define is named as 6.0.0-7.0.1 name it (a
        command of another version), else ``CMD_<n>``."""
        cmd = self.command_at(wire)
        return cmd.name if cmd is not None else command_name(wire)

    @property
    def sentinel(self) -> int:
        """Wire id of NONE, the client-side sentinel a server closes on."""
        return self.ids[Command.NONE]

    @property
    def label(self) -> str:
        return ".".join(str(x) for x in self.version)

    @property
    def major(self) -> int:
        return self.version[0]

    @property
    def command_count(self) -> int:
        """RPC_CMD_COUNT: one past the highest command id, the NONE sentinel included."""
        return max(self.ids[c] for c in (*self.commands, *NEVER_ON_WIRE)) + 1

    def spec(self, command: int) -> CommandSpec | None:
        """The command's spec in this version, or None if a server of this version closes on it.

        A :class:`Command` is looked up as itself; a plain ``int`` is a wire id of this version."""
        if not isinstance(command, Command):
            command = self.command_at(command)  # type: ignore[assignment]
            if command is None:
                return None
        return self.commands.get(command)

    def derive(
        self,
        version: tuple[int, int, int],
        *,
        replace: Mapping[Command, CommandSpec] | None = None,
        add: Mapping[Command, CommandSpec] | None = None,
        cache_rule: CacheRule | None = None,
        changes: tuple[str, ...] = (),
        ids: Mapping[Command, int] | None = None,
        graph_cache_max: int | None = None,
    ) -> Protocol:
        """A successor version that differs only by what is given here (``ids``: wire ids that differ from the
        parent's, new commands' included)."""
        table = dict(self.commands)
        for cmd, spec in (replace or {}).items():
            if cmd not in table:
                raise KeyError(f"{cmd.name} is not in {self.label}: use add=")
            table[cmd] = spec
        for cmd, spec in (add or {}).items():
            if cmd in table:
                raise KeyError(f"{cmd.name} already exists in {self.label}: use replace=")
            table[cmd] = spec
        wire = dict(self.ids) | dict(ids or {})
        return Protocol(
            version,
            MappingProxyType(dict(sorted(table.items(), key=lambda kv: wire[kv[0]]))),
            cache_rule or self.cache_rule,
            self,
            changes,
            MappingProxyType(wire),
            graph_cache_max if graph_cache_max is not None else self.graph_cache_max,
        )


def _c(cmd: Command, request: m.Payload, reply: m.Payload | m._NoReply, doc: str) -> tuple[Command, CommandSpec]:
    return cmd, CommandSpec(cmd, request, reply, doc)


C = Command
V6 = Protocol(
    (6, 0, 0),
    MappingProxyType(
        dict(
            [
                _c(C.ALLOC_BUFFER, m.ALLOC_BUFFER_REQ, m.ALLOC_BUFFER_REPLY, "allocate a device buffer"),
                _c(C.GET_ALIGNMENT, m.DEVICE_REQ, m.GET_ALIGNMENT_REPLY, "alignment of the device's buffers"),
                _c(C.GET_MAX_SIZE, m.DEVICE_REQ, m.GET_MAX_SIZE_REPLY, "largest buffer of the device"),
                _c(C.BUFFER_GET_BASE, m.BUFFER_REQ, m.BUFFER_GET_BASE_REPLY, "base address of a buffer"),
                _c(C.FREE_BUFFER, m.BUFFER_REQ, m.NO_REPLY, "free a buffer"),
                _c(C.BUFFER_CLEAR, m.BUFFER_CLEAR_REQ, m.NO_REPLY, "fill a whole buffer with one byte"),
                _c(C.SET_TENSOR, m.SET_TENSOR_V6_REQ, m.NO_REPLY, "write tensor data"),
                _c(C.SET_TENSOR_HASH, m.SET_TENSOR_HASH_REQ, m.RESULT_REPLY, "write tensor data from the cache"),
                _c(C.GET_TENSOR, m.GET_TENSOR_REQ, m.GET_TENSOR_REPLY, "read tensor data"),
                _c(C.COPY_TENSOR, m.COPY_TENSOR_REQ, m.RESULT_REPLY, "copy one tensor into another"),
                _c(C.GRAPH_COMPUTE, m.GRAPH_COMPUTE_REQ, m.NO_REPLY, "compute a graph and store it for recompute"),
                _c(C.GET_DEVICE_MEMORY, m.DEVICE_REQ, m.GET_DEVICE_MEMORY_REPLY, "free and total device memory"),
                _c(C.INIT_TENSOR, m.INIT_TENSOR_REQ, m.NO_REPLY, "backend-specific tensor initialisation"),
                _c(C.GET_ALLOC_SIZE, m.GET_ALLOC_SIZE_REQ, m.GET_ALLOC_SIZE_REPLY, "allocation size of a tensor"),
                _c(C.HELLO, m.HELLO_REQ, m.HELLO_REPLY, "handshake: must be the first command, and only once"),
                _c(C.DEVICE_COUNT, m.EMPTY_REQ, m.DEVICE_COUNT_REPLY, "number of devices"),
                _c(C.GRAPH_RECOMPUTE, m.DEVICE_REQ, m.NO_REPLY, "re-run the graph stored for a device"),
                _c(C.MEMSET_TENSOR, m.MEMSET_TENSOR_REQ, m.NO_REPLY, "fill part of a tensor with one byte"),
            ]
        )
    ),
    SIZE_RULE,
)

V7 = V6.derive(
    (7, 0, 0),
    replace=dict([_c(C.SET_TENSOR, m.SET_TENSOR_V7_REQ, m.NO_REPLY, "write tensor data; may ask for a cache save")]),
    cache_rule=FLAG_RULE,
    changes=(
        "HELLO reply major byte 6 -> 7",
        "SET_TENSOR gains a 1-byte cache_flag after the tensor (header 304 -> 305 bytes, offset at 297)",
        "cache rule: the server saves only flagged payloads, at any size (was: every payload > 10 MiB)",
    ),
)

V7_0_1 = V7.derive(
    (7, 0, 1),
    add=dict(
        [
            _c(
                C.GET_DEVICE_SUPPORTS_OP,
                m.SUPPORTS_OP_REQ,
                m.SUPPORTS_OP_REPLY,
                "does the device support this op (clients send it only to servers of patch >= 1)",
            )
        ]
    ),
    changes=("GET_DEVICE_SUPPORTS_OP = 19 added (after NONE; RPC_CMD_COUNT 19 -> 20)",),
)

#: 8.0.0 (llama.cpp b11739): two-dimensional transfers and a two-server communicator for tensor split; graphs
#: kept per uid.  Built from 7.0.0: 7.0.1's GET_DEVICE_SUPPORTS_OP (id 19, never released) is not in it, and its
#: id 19 is GET_TENSOR_2D here.
V8 = V7.derive(
    (8, 0, 0),
    replace=dict([
        _c(C.GRAPH_COMPUTE, m.GRAPH_COMPUTE_V8_REQ, m.NO_REPLY,
           "compute a graph, asynchronously; keep it under its uid for GRAPH_RECOMPUTE"),
        _c(C.GRAPH_RECOMPUTE, m.GRAPH_RECOMPUTE_V8_REQ, m.NO_REPLY, "re-run the graph stored under (device, uid)"),
    ]),
    add=dict([
        _c(C.SET_TENSOR_2D, m.SET_TENSOR_2D_REQ, m.NO_REPLY, "write rows of a tensor, stride apart"),
        _c(C.GET_TENSOR_2D, m.GET_TENSOR_2D_REQ, m.GET_TENSOR_2D_REPLY, "read rows of a tensor, stride apart"),
        _c(C.COMM_INIT, m.COMM_INIT_REQ, m.COMM_INIT_REPLY,
           "join a two-server communicator: rank 0 listens on port, rank 1 connects to host:port"),
        _c(C.COMM_ALLREDUCE, m.COMM_ALLREDUCE_REQ, m.NO_REPLY,
           "sum a tensor over both ranks of the communicator, through the servers' own link"),
        _c(C.COMM_FREE, m.DEVICE_REQ, m.NO_REPLY, "leave the communicator (closes the servers' link)"),
    ]),
    ids={C.SET_TENSOR_2D: 18, C.GET_TENSOR_2D: 19, C.COMM_INIT: 20, C.COMM_ALLREDUCE: 21, C.COMM_FREE: 22,
         C.NONE: 23},
    graph_cache_max=GRAPH_CACHE_MAX,
    changes=(
        "HELLO reply major byte 7 -> 8",
        "GRAPH_COMPUTE gains a u64 uid after device (smallest payload 12 -> 20 bytes); a non-zero uid keeps the "
        f"graph under (device, uid), at most {GRAPH_CACHE_MAX} per device (then that device's graphs are dropped)",
        "GRAPH_RECOMPUTE's request is device + uid (4 -> 12 bytes) and re-runs the graph stored under that uid",
        "SET_TENSOR_2D = 18, GET_TENSOR_2D = 19, COMM_INIT = 20, COMM_ALLREDUCE = 21 (no reply), COMM_FREE = 22 "
        "(no reply) added; the NONE sentinel moves 18 -> 23 (RPC_CMD_COUNT 24)",
        "graphs compute asynchronously; every command that reads or writes buffer data waits for them first",
        "COMM_INIT makes two servers open a TCP link of their own (the servers' link), which carries "
        "COMM_ALLREDUCE's partial sums",
        "7.0.1's GET_DEVICE_SUPPORTS_OP (id 19, a branch never released) is not in 8.0.0, whose id 19 is "
        "GET_TENSOR_2D: a 7.0.1 client's question is a malformed GET_TENSOR_2D to an 8.0.0 server (3,260 bytes, "
        "not 328: it closes)",
    ),
)

#: Every version this kit covers, oldest first.
PROTOCOLS: tuple[Protocol, ...] = (V6, V7, V7_0_1, V8)
BY_LABEL: dict[str, Protocol] = {p.label: p for p in PROTOCOLS}


def protocol_for(major: int, minor: int, patch: int) -> Protocol | None:
    """The table a server announcing this version speaks, or None when the kit does not cover it.

    A later patch of a covered major.minor speaks at least the newest covered patch's commands.
    """
    best = None
    for p in PROTOCOLS:
        if p.version[:2] == (major, minor) and p.version[2] <= patch:
            best = p
    return best


def parse_version_option(text: str) -> Protocol:
    """Turn a ``--proto`` value (``6``, ``7``, ``7.0.1``…) into a table; raises ValueError for anything else."""
    text = text.strip()
    if text in BY_LABEL:
        return BY_LABEL[text]
    for p in PROTOCOLS:
        if text == str(p.major) and p.version[1:] == (0, 0):
            return p
        if text == f"{p.version[0]}.{p.version[1]}" and p.version[2] == 0:
            return p
    choices = ", ".join(["6", "7", "8", *BY_LABEL])
    raise ValueError(f"unknown protocol version {text!r} (choose from {choices})")
