"""``ggml-rpc decode FILE.pcap``: every message of every connection, one line (or one JSON object) each."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import TextIO

from ggml_rpc.spec import Direction, Protocol, Reply, Request

from ..sessions.capture import CaptureError, Connection, read_connections
from ..sessions.decode import DecodedConnection, describe, iter_connection, summarize
from ..sessions.peer_link import decode_peer_link, describe_link, link_ports
from .options import STDOUT, UsageError, output_file, parse_proto, port_number, proto_help


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pcap", help="capture file (pcap or pcapng); '-': standard input (what `ggml-rpc pcap record "
                   "-o -` writes), kept in a temporary file while it is decoded")
    p.add_argument("--proto", default="auto", help=proto_help("auto", auto="from each HELLO reply"))
    p.add_argument("--port", type=port_number, default=None, help="only connections with this TCP port")
    p.add_argument("--json", metavar="FILE|-", default=None, help="also write JSON lines (one object per event and "
                   "message) to FILE; '-': on standard output, instead of the text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    protocol = parse_proto(args.proto)
    if args.json is not None:
        output_file(args.json, "--json")
    with contextlib.ExitStack() as stack:
        path = stack.enter_context(_from_stdin()) if args.pcap == STDIN else args.pcap
        try:
            conns = read_connections(path, port=args.port)
        except CaptureError as exc:
            raise UsageError(str(exc).replace(path, "standard input") if args.pcap == STDIN else str(exc)) from None
        if not conns:
            where = f" with port {args.port}" if args.port is not None else ""
            shown = "standard input" if args.pcap == STDIN else args.pcap
            print(f"ggml-rpc decode: no TCP connection{where} in {shown}", file=sys.stderr)
        js: TextIO | None = None
        if args.json is not None:
            js = sys.stdout if args.json == STDOUT else stack.enter_context(_open_file(args.json))
        # The text listing goes to standard output unless the JSON lines take it.
        return _decode(args.pcap, conns, protocol, None if args.json == STDOUT else sys.stdout, js)


#: The capture argument that names standard input.
STDIN = "-"


@contextlib.contextmanager
def _from_stdin() -> Iterator[str]:
    """Standard input copied, a chunk at a time, into a temporary file (a capture is read by offsets, in bounded
    memory: the file is what it reads), removed afterwards."""
    with tempfile.NamedTemporaryFile(prefix="ggml-rpc-decode-", suffix=".pcap") as tmp:
        shutil.copyfileobj(sys.stdin.buffer, tmp, 1 << 20)
        tmp.flush()
        yield tmp.name


def _open_file(path: str) -> TextIO:
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _decode(path: str, conns: list[Connection], protocol: Protocol | None, out: TextIO | None,
            js: TextIO | None) -> int:
    """Printed connection by connection, message by message, in bounded memory: a message's bulk data is never read
    except to hash a GET_TENSOR reply, and only what the servers' link needs (COMM_* requests) is kept.  A
    connection is decoded twice: once for what its heading says (version, notes found while decoding), then printed
    as it is decoded again (bulk is skipped unread, so a pass costs little next to printing)."""
    failed = 0
    decoded: list[DecodedConnection] = []
    for conn in conns:
        found = link_ports(decoded).get(conn.server[1])
        dc = DecodedConnection(conn, protocol, notes=list(conn.notes))
        messages: Iterator[Request | Reply] = iter(())
        if found is not None and conn.start >= found[0].conn.start:
            dc = decode_peer_link(conn, found[0], found[1], conn.server[1])
        else:
            for _msg in iter_connection(conn, protocol, out=dc, keep=_comm):
                pass
            messages = iter_connection(conn, protocol, keep=lambda _m: False)
        decoded.append(dc)
        _heading(out, js, dc)
        counts = {"requests": 0, "replies": 0}
        for msg in messages:
            counts["replies" if isinstance(msg, Reply) else "requests"] += 1
            arrow = "<" if isinstance(msg, Reply) else ">"
            index = msg.request.index if isinstance(msg, Reply) and msg.request else msg.index
            if js is not None:
                rec = {"connection": conn.index, "dir": "reply" if arrow == "<" else "request", "index": index}
                rec.update(summarize(msg))
                js.write(json.dumps(rec) + "\n")
            if out is not None:
                out.write(f"{conn.index:>3} {index:>5} {arrow} {describe(msg)}\n")
        if dc.error is not None:
            failed += 1
            err = dc.error
            msg_index = counts["requests"] if dc.error_direction is Direction.C2S else counts["replies"]
            line = f"connection {conn.index} ({dc.error_direction}), message {msg_index}: {err}"
            if js is not None:
                js.write(json.dumps({"connection": conn.index, "event": "error", "direction": dc.error_direction,
                                     "message_index": msg_index, "command": err.command, "field": err.field,
                                     "offset": err.offset, "error": err.message}) + "\n")
            print(f"ggml-rpc decode: spec violation: {line}", file=sys.stderr)
        for cut in dc.cuts:
            # A damaged capture is not a clean decode: said where the listing stops, and exit 1.
            failed += 1
            if js is not None:
                js.write(json.dumps({"event": "truncated", "file": path, **cut.as_dict()}) + "\n")
            if out is not None:
                out.write(f"#   {cut.line()}\n")
            print(f"ggml-rpc decode: {path}: {cut.line()}", file=sys.stderr)
    return 1 if failed else 0


def _comm(msg: Request | Reply) -> bool:
    return msg.command.name.startswith("COMM_")


def _heading(out: TextIO | None, js: TextIO | None, dc: DecodedConnection) -> None:
    """The connection's heading (and the servers' link, when it is one)."""
    conn = dc.conn
    version = dc.protocol.label if dc.protocol else "?"
    if js is not None:
        js.write(json.dumps({"connection": conn.index, "event": "open", "client": list(conn.client),
                             "server": list(conn.server), "version": version, "notes": dc.notes}) + "\n")
        if dc.link is not None:
            js.write(json.dumps({"connection": conn.index, "event": "link", "port": dc.link.port,
                                 "init": list(dc.link.init),
                                 "exchanges": [vars(x) for x in dc.link.exchanges]}) + "\n")
    if out is not None:
        out.write(f"# connection {conn.index}: {conn.label} protocol {version}\n")
        for note in dc.notes:
            out.write(f"#   note: {note}\n")
        if dc.link is not None:
            for line in describe_link(dc):
                out.write(f"{conn.index:>3}       = {line}\n")
