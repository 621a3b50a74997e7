"""Replaying captured sessions against any server.

The client side of every connection of the captures is sent again, in order, one connection at a time, and each reply
is compared with the recorded one by class (exact, recorded, computed within a tolerance, close: see :mod:`.compare`).
Server-assigned values (buffer handles, bases) are relocated to the target's and the target's hash cache is modelled
(:mod:`.relocate`).

``as_protocol`` rewrites the session for a server of another version: SET_TENSOR gains or loses its cache_flag byte
(set, as the v7 client does, only on the SET_TENSOR that follows a hash miss); graph uids are added or dropped
(:mod:`.rewrite`, which also refuses what has no sound equivalent).

A client that closed before reading its replies is replayed so: requests sent, the connection closed unread (a server
that dies of SIGPIPE shows as the next connection refused).  A cache hit the target cannot have gets the data instead,
from any SET_TENSOR of the loaded captures with that hash (or a report that no capture holds it).

A capture that ends inside a message (:mod:`.truncation`) is replayed up to it, reported as a cut (the run fails),
never as the target's mismatch.

Bulk data never lies whole in memory: a request's data still in the capture file is sent from it a slice at a time,
and a large reply is received and compared a slice at a time.

Before anything of the captures is sent, the target must answer a HELLO of its own as a ggml RPC server (else the
replay is refused at once: a server of another protocol would keep every replayed connection waiting the whole reply
timeout); a target that announces another version than the captures' is told the ``--as`` that rewrites them.

A target that stops accepting connections during the replay (a refused connect after the first connection), or that no
longer answers HELLO once the replay is done, died of what was sent: a mismatch of kind ``death`` naming the last
message sent, never "0 mismatches".  The harness's replay_spawn restarts a spawned target after each death.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ggml_rpc.spec import (
    REPLY_HEADER_SIZE,
    Command,
    Direction,
    HandshakeError,
    Protocol,
    ProtocolError,
    Reply,
    Request,
    SizeMismatch,
    request_parts,
)
from ggml_rpc.spec.payloads import REQUEST_HEADER

from ..client import ConnectionClosed, RpcClient
from .compare import DEFAULT_NMSE, Mismatch, ReplayReport, ReplyComparer, tensor_label
from .decode import DecodedConnection
from .lint import follows_miss
from .op_closeness import GraphOps
from .relocate import Relocator, TargetCache
from .replay_captures import (
    LoadedCapture,
    Payloads,
    ReplayError,
    cut_at,
    left_before_reply,
    load_captures,
    source_protocol,
)
from .rewrite import GraphRewrite, RewriteRefused, check_rewritable
from .spans import LazyBytes

# ---- bulk I/O: requests whose data is still in the capture file are sent a slice at a time, and large replies
# received a slice at a time, so neither is ever whole in memory.

#: Bulk data is sent from the capture, and large replies read and compared, this many bytes at a time.
SLICE = 4 << 20


def send_request(client: RpcClient, target: Protocol, cmd: Command, fields: dict[str, Any],
                 data: memoryview | LazyBytes | None) -> int:
    """Send one request; bulk data still in the capture goes from the file a slice at a time.  Returns the bytes
    sent."""
    if not isinstance(data, LazyBytes):
        parts = request_parts(target, cmd, fields, data)
        client.send_raw(parts)
        return sum(memoryview(p).nbytes for p in parts)
    # The header and fixed fields as encoded without data, the size header then counting the data that follows.
    parts = request_parts(target, cmd, fields, None)
    size = sum(memoryview(p).nbytes for p in parts[1:]) + data.nbytes
    spec = target.spec(cmd)
    assert spec is not None
    parts[0] = REQUEST_HEADER.pack(target.wire_id(spec.command), size)
    client.send_raw(parts)
    for views in data.stream.windows(data.start, data.stop, SLICE):
        client.send_raw(views)
    return REQUEST_HEADER.size + size


def received(client: RpcClient, size: int) -> Iterator[memoryview]:
    """A reply body of ``size`` bytes read from the socket in slices of :data:`SLICE` (one buffer, reused: each
    slice is valid until the next is asked for).  Always reads the whole body, so the connection stays framed."""
    buf = memoryview(bytearray(min(size, SLICE)))
    left = size
    while left:
        n = min(left, SLICE)
        client._recv_into(buf[:n])
        left -= n
        yield buf[:n]


class _TargetStopped(Exception):
    """The target refused a connection after having accepted earlier ones (it died of the replay)."""


#: The kind of the mismatch that reports a target that died during the replay.
DEATH = "death"
#: Seconds the target has to answer the HELLO that opens a replay (at most: the reply timeout when shorter).
GREETING_TIMEOUT = 5.0


class Replayer:
    """Replays decoded captures against one server at ``host:port``."""

    def __init__(
        self,
        captures: Sequence[LoadedCapture],
        host: str,
        port: int,
        *,
        as_protocol: Protocol | None = None,
        nmse_tolerance: float = DEFAULT_NMSE,
        timeout: float = 120.0,
        until_compute: bool = False,
        rewrite_fields: Callable[[Command, dict[str, Any]], dict[str, Any]] | None = None,
        graph_hook: Callable[[RpcClient, Command, dict[str, Any], Request, int], bool] | None = None,
    ) -> None:
        self.captures = list(captures)
        #: Called before each GRAPH_COMPUTE/RECOMPUTE with its relocated fields and connection index (the divergence
        #: finder's own graphs go there); False stops replaying that connection.
        self.graph_hook = graph_hook
        #: A fleet replay readdresses COMM_INIT (:mod:`.fleet`): applied to every relocated request.
        self.rewrite_fields = rewrite_fields
        self.until_compute = until_compute
        # With --as, captures of different versions may be mixed: each connection is rewritten from its own.
        self.source = source_protocol(self.captures, as_protocol) if as_protocol is None else as_protocol
        self.target = as_protocol or self.source
        labels = sorted({dc.protocol.label for cap in self.captures for dc in cap.connections
                         if dc.protocol is not None}) or [self.source.label]
        self.host, self.port = host, port
        self.timeout = timeout
        self._payloads = Payloads(self.captures)  # the data a cache hit the target cannot have needs
        if as_protocol is not None:
            try:
                check_rewritable(((cap.path, dc) for cap in self.captures for dc in cap.connections), as_protocol)
            except RewriteRefused as exc:
                raise ReplayError(str(exc)) from None
        report = ReplayReport(target=f"{host}:{port}", source_versions=labels, target_version=self.target.label)
        self.compare = ReplyComparer(self.target, report, TargetCache(self.target), nmse_tolerance)

    # The comparer holds the report and the target's cache model (``ggml-rpc bench`` hands it an earlier one).

    @property
    def report(self) -> ReplayReport:
        return self.compare.report

    @property
    def cache(self) -> TargetCache:
        return self.compare.cache

    @cache.setter
    def cache(self, cache: TargetCache) -> None:
        self.compare.cache = cache

    # -- running --

    def run(self, *, check_alive: bool = True) -> ReplayReport:
        """Replay every connection; with ``check_alive``, greet the target with a HELLO of its own first and make
        sure it still answers one after (a target that died of the last message closes "as recorded" and would
        otherwise pass).  Without it the target is taken as it is: a one-connection listener is not a server."""
        if check_alive:
            self._greet()
        start = time.perf_counter()
        #: The last request sent: (file, connection, message index, command), for attributing a death.
        self._last: tuple[str, int, int, str] | None = None
        #: The last request the target answered (index, command): the death came after it.
        self._answered: tuple[int, str] | None = None
        try:
            for cap in self.captures:
                for dc in cap.connections:
                    if dc.link is not None:
                        continue  # a servers' link (8.0.0): the servers open their own when replayed
                    self.report.connections += 1
                    self._play(cap.path, dc)
        except _TargetStopped as exc:
            self.report.connections -= 1  # the refused connection was not replayed
            self._died(str(exc))
        else:
            self.report.seconds = time.perf_counter() - start
            if check_alive and self._last is not None:
                why = self._not_answering()
                if why is not None:
                    self._died(why)
        self.report.seconds = time.perf_counter() - start
        return self.report

    def _greet(self) -> None:
        """Before anything of the captures is sent, the target must answer HELLO as a ggml RPC server (an HTTP
        server, say, would otherwise keep each replayed connection waiting the whole reply timeout); the version it
        announces, when not the captures', is noted with the ``--as`` that rewrites the session for it."""
        where = f"{self.host}:{self.port}"
        try:
            with RpcClient.connect(self.host, self.port, timeout=min(self.timeout, GREETING_TIMEOUT),
                                   hello=False) as client:
                try:
                    client.hello()
                except HandshakeError:
                    pass  # a version the kit does not cover: the replay's own HELLO replies say so
                version = client.server_version
        except (ConnectionClosed, ProtocolError, TimeoutError) as exc:
            raise ReplayError(f"{where} does not answer HELLO as a ggml RPC server: {exc or type(exc).__name__}") \
                from None
        except OSError as exc:
            raise ReplayError(f"cannot connect to {where}: {exc.strerror or exc}") from None
        if version is not None and version[0] != self.target.version[0]:
            spoken = ".".join(map(str, version))
            self.report.notes.append(f"{where} speaks {spoken}, the captures are replayed as {self.target.label}: "
                                     f"replay them with --as {version[0]} to rewrite the session for it")

    def _play(self, path: str, dc: DecodedConnection) -> None:
        self._connection(path, dc)  # the harness's replay_spawn restarts a spawned target around it

    def _not_answering(self) -> str | None:
        """None when the target accepts a connection and answers HELLO; otherwise what happened."""
        try:
            with RpcClient.connect(self.host, self.port, timeout=min(self.timeout, 5.0), protocol=self.target):
                return None
        except ConnectionRefusedError:
            return "connection refused"
        except (OSError, ConnectionClosed, ProtocolError) as exc:
            return f"no HELLO reply ({exc or type(exc).__name__})"

    def _died(self, how: str) -> None:
        """Record that the target stopped accepting connections, after the last message sent."""
        path, conn, index, command = self._last or ("?", 0, 0, "?")
        self.report.mismatches.append(Mismatch(
            path, conn, index, command, DEATH, "the server to keep accepting connections",
            f"the server stopped accepting connections after message {index} ({command}) of connection {conn} of "
            f"{path}" + (f" (last reply: message {self._answered[0]}, {self._answered[1]})" if self._answered else "")
            + f": {how}"))

    def _connection(self, path: str, dc: DecodedConnection) -> None:
        replies = {id(r.request): r for r in dc.replies}
        reloc = Relocator()
        computed = False
        # Regions written since the last graph ran (recorded address -> bytes): reading one back is exact.
        written: dict[int, int] = {}
        last_miss: Request | None = None
        graphs, graph_ops = GraphRewrite(dc.protocol or self.source, self.target), GraphOps()
        left_at = left_before_reply(dc)
        stop = cut_at(dc)
        requests = dc.requests if stop is None else [r for r in dc.requests if r.index < stop]
        for cut in dc.cuts:
            self.report.cuts.append(f"{path} {cut.line()}; not replayed from message {stop} on")
        if stop == 0:
            return  # cut before its first request was whole: nothing to send
        try:
            client = RpcClient(socket.create_connection((self.host, self.port), timeout=self.timeout),
                               self.target)
        except OSError as exc:
            if self._last is not None:
                # It accepted earlier connections of this replay: it died of what was sent, not a wrong address.
                raise _TargetStopped(f"connect: {exc.strerror or exc}") from None
            raise ReplayError(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with client:
            for req in requests:
                cmd = req.command
                if self.until_compute and cmd in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
                    left = len(dc.requests) - req.index
                    self.report.notes.append(f"{path} connection {dc.conn.index}: stopped at message {req.index} "
                                             f"({cmd.name}), {left} request(s) not replayed (--until-compute)")
                    return
                self.report.requests += 1
                rec = replies.get(id(req))
                fields = reloc.fields(req.fields)
                cmd, fields = graphs.request(cmd, fields)
                if self.rewrite_fields is not None:
                    fields = self.rewrite_fields(cmd, fields)
                data = req.data
                if cmd is Command.SET_TENSOR:
                    fields = self._set_tensor_fields(fields, last_miss, req, dc.protocol)
                    self.cache.sent(data, self._flag(fields))
                    if computed and data is not None:
                        written[req.fields["tensor"]["data"] + req.fields["offset"]] = data.nbytes
                last_miss = None
                if cmd is Command.SET_TENSOR_HASH and rec is not None and rec.fields["result"] == 1 \
                        and not self.cache.holds(req.fields["hash"]):
                    if not self._supply(path, dc, req, fields, client):
                        return
                    continue
                spec = self.target.spec(cmd)
                if spec is None:
                    self.compare.mismatch(path, dc, req, "exact", f"a {cmd.name} request", f"no such command in "
                                          f"{self.target.label}")
                    return
                leaving = spec.has_reply and left_at is not None and (rec is None or rec.offset >= left_at)
                if leaving:
                    client.cork()  # this request's last bytes leave with the FIN, as a client that does not wait
                self._last = (path, dc.conn.index, req.index, cmd.name)
                if self.graph_hook is not None and cmd in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE) \
                        and not self.graph_hook(client, cmd, fields, req, dc.conn.index):
                    return
                try:
                    self.report.bytes_sent += send_request(client, self.target, cmd, fields, data)
                    if cmd in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
                        computed = True
                        written.clear()
                        graph_ops.graph(req.fields)
                    if not spec.has_reply:
                        continue
                    if leaving:
                        self._leave(path, dc, req, client, reloc)
                        return
                    expected_size = spec.reply_size(req.fields)
                    if rec is None:
                        self.report.compared["close"] += 1
                        if not client.expect_closed(timeout=min(self.timeout, 5.0)):
                            self.compare.mismatch(path, dc, req, "close", "the server to close the connection (as "
                                                  "recorded)", "a reply or an open connection")
                        return
                    # The size header first: a large read is then received and compared a slice at a time.
                    size = client._recv_size()
                    if size > max(expected_size, 1 << 16):
                        raise SizeMismatch(f"reply size claim {size} exceeds the limit "
                                           f"{max(expected_size, 1 << 16)}", field="size")
                    # A read of bytes written since the last graph is exact; one of a graph's result, by its op.
                    fresh = cmd is Command.GET_TENSOR and written.get(
                        req.fields["tensor"]["data"] + req.fields["offset"], 0) >= req.fields["size"]
                    judged, op = computed and not fresh, graph_ops.read_op(req.fields) if computed else None
                    if size == expected_size > SLICE and cmd in (Command.GET_TENSOR, Command.GET_TENSOR_2D):
                        self.report.bytes_received += REPLY_HEADER_SIZE + size
                        got_slices = received(client, size)
                        self.compare.large_read(path, dc, req, rec, got_slices, judged, op)
                        for _rest in got_slices:  # whatever the comparison did not need is still read
                            pass
                        continue
                    body = bytearray(size)
                    client._recv_into(memoryview(body))
                except ConnectionClosed as exc:
                    if self._recorded_close_from(dc, req, replies, stop):
                        self.report.compared["close"] += 1  # closed a little earlier than we could ask: as recorded
                        return
                    self.compare.mismatch(path, dc, req, "transport", "a reply" if rec is not None else "no reply",
                                          f"connection closed ({exc})")
                    return
                except OSError as exc:
                    self.compare.mismatch(path, dc, req, "transport", "a reply", f"socket error ({exc})")
                    return
                except ProtocolError as exc:  # a size header no reply of this command can have (not an RPC server?)
                    self.compare.mismatch(path, dc, req, "exact", f"a {expected_size}-byte reply", str(exc))
                    return
                self.report.bytes_received += REPLY_HEADER_SIZE + len(body)
                self._answered = (req.index, cmd.name)
                if len(body) != expected_size:
                    self.compare.mismatch(path, dc, req, "exact", f"a {expected_size}-byte reply", f"{len(body)} bytes")
                    return
                got = memoryview(body)
                self.compare.reply(path, dc, req, rec, got, judged, reloc, op)
                if cmd is Command.SET_TENSOR_HASH:
                    hit = got[0] != 0
                    if not hit:
                        last_miss = req
            if dc.error is not None:
                self._send_broken_tail(path, dc, client)

    def _leave(self, path: str, dc: DecodedConnection, req: Request, client: RpcClient, reloc: Relocator) -> None:
        """The recorded client closed before reading this reply: send what it sent after it, read nothing, close
        (unread replies make the client's host reset the connection, as in the capture)."""
        for later in dc.requests[req.index + 1 :]:
            self.report.requests += 1
            try:
                self.report.bytes_sent += send_request(client, self.target, later.command,
                                                       reloc.fields(later.fields), later.data)
            except (ConnectionClosed, OSError):
                break
        self.report.notes.append(f"{path} connection {dc.conn.index}: the client left before reading the reply to "
                                 f"message {req.index} ({req.command.name}), as recorded (its FIN came first)")

    def _send_broken_tail(self, path: str, dc: DecodedConnection, client: RpcClient) -> None:
        """Send the client bytes from the first request that does not decode, and expect the server to close."""
        last = dc.requests[-1] if dc.requests else None
        start = last.offset + last.wire_size if last is not None else 0
        self._last = (path, dc.conn.index, len(dc.requests), dc.error.command if dc.error and dc.error.command else "?")
        self.report.requests += 1
        self.report.compared["close"] += 1
        try:
            for views in dc.conn.c2s.stream.windows(start, window=SLICE):  # from the capture, a slice at a time
                client.send_raw(views)
                self.report.bytes_sent += sum(v.nbytes for v in views)
        except ConnectionClosed:
            return  # closed while we were still sending: what the recorded server did
        if not client.expect_closed(timeout=min(self.timeout, 5.0)):
            assert dc.error is not None
            self.report.mismatches.append(Mismatch(
                path, dc.conn.index, len(dc.requests), dc.error.command or "?", "close",
                f"the server to close on bytes that break the spec ({dc.error.message})",
                "a reply or an open connection"))

    def _recorded_close_from(self, dc: DecodedConnection, req: Request, replies: dict[int, Reply],
                             stop: int | None = None) -> bool:
        """Did the recorded server close at or before ``req``: no reply recorded from here on, and a later request
        that should have had one got none (or the client stream breaks the spec)?  Requests from the cut: unknown."""
        later = [r for r in dc.requests[req.index :] if stop is None or r.index < stop]
        if any(id(r) in replies for r in later):
            return False
        if dc.error is not None and dc.error_direction is Direction.C2S:
            return True
        return any((spec := self.target.spec(r.command)) is not None and spec.has_reply for r in later)

    def _flag(self, fields: dict[str, Any]) -> int:
        """The cache flag of a SET_TENSOR in the target's layout (0 where the layout has none)."""
        name = self.target.cache_rule.flag_field
        return int(fields.get(name, 0)) if name else 0

    def _set_tensor_fields(self, fields: dict[str, Any], last_miss: Request | None, req: Request,
                           dc_protocol: Protocol | None) -> dict[str, Any]:
        """SET_TENSOR in the target's layout (cache_flag added or dropped for a cross-version replay)."""
        flag_field = self.target.cache_rule.flag_field
        source = dc_protocol or self.source
        if source.cache_rule.flag_field == flag_field:
            return fields
        fields = dict(fields)
        if flag_field is None:
            fields.pop(source.cache_rule.flag_field, None)
        else:
            fields[flag_field] = int(last_miss is not None and follows_miss(last_miss.fields, req.fields))
        return fields

    def _supply(self, path: str, dc: DecodedConnection, req: Request, fields: dict[str, Any],
                client: RpcClient) -> bool:
        """The capture hit a cache entry the target cannot hold: send the data instead (or report why not)."""
        digest = req.fields["hash"]
        data = self._payloads.data_for(digest)
        name = tensor_label(req.fields["tensor"])
        if data is None:
            self.compare.mismatch(path, dc, req, "exact", f"a cache hit for {digest:016x} ({name})",
                                  "a target cache without it, and no loaded capture holds data with that hash to "
                                  "supply")
            return False
        self.report.notes.append(
            f"{path} connection {dc.conn.index} message {req.index}: the capture hits cache entry {digest:016x} "
            f"({name}) that the target cannot hold yet; sent its {data.nbytes} bytes with SET_TENSOR instead")
        set_fields = {"tensor": fields["tensor"], "offset": fields["offset"]}
        if self.target.cache_rule.flag_field:
            set_fields[self.target.cache_rule.flag_field] = 1
        self.cache.sent(data, self._flag(set_fields))
        try:
            self.report.bytes_sent += send_request(client, self.target, Command.SET_TENSOR, set_fields, data)
        except ConnectionClosed as exc:
            self.compare.mismatch(path, dc, req, "transport", "the supplied data to be accepted",
                                  f"connection closed ({exc})")
            return False
        return True


def replay(
    paths: Sequence[str | Path],
    host: str,
    port: int,
    *,
    as_protocol: Protocol | None = None,
    protocol: Protocol | None = None,
    nmse_tolerance: float = DEFAULT_NMSE,
    timeout: float = 120.0,
    until_compute: bool = False,
    check_alive: bool = True,
) -> ReplayReport:
    """Decode ``paths`` and replay them against ``host:port`` (``check_alive``: the target must answer a HELLO of its
    own before, and still answer one after, so that a death on the last message is not taken for the recorded
    close)."""
    captures = load_captures(paths, protocol)
    return Replayer(captures, host, port, as_protocol=as_protocol, nmse_tolerance=nmse_tolerance,
                    timeout=timeout, until_compute=until_compute).run(check_alive=check_alive)


__all__ = ["DEATH", "LoadedCapture", "ReplayError", "Replayer", "cut_at", "left_before_reply", "load_captures",
           "replay", "source_protocol"]
