"""A server that dies like upstream 6.0/7.0 builds do on a null graph node: for the --spawn tests.

``python fragile_server.py --port N [--proto 7]`` runs the reference server behind a relay on 127.0.0.1:N; a
GRAPH_COMPUTE whose node list holds id 0 makes the whole process abort (SIGABRT) after a log line, as an
upstream server segfaults there. ``--die-on get-tensor`` aborts on any GET_TENSOR instead (the first step of
FRAME-010, whose later steps then find no server); ``--startup-delay S`` waits before listening, as a slow server
coming back after a restart does.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faulty import Act, Breaker, Conn, FaultyServer, Msg
from ggml_rpc.reference import running_server
from ggml_rpc.spec import Command, parse_version_option


class AbortOnNullNode(Breaker):
    def request(self, conn: Conn, msg: Msg) -> Act | None:
        if msg.cmd == Command.GRAPH_COMPUTE and msg.fields is not None and 0 in msg.fields["nodes"].tolist():
            print("fatal: GRAPH_COMPUTE with a null node, aborting", flush=True)
            os.abort()
        return None


class AbortOnGetTensor(Breaker):
    def request(self, conn: Conn, msg: Msg) -> Act | None:
        if msg.cmd == Command.GET_TENSOR:
            print("fatal: GET_TENSOR, aborting", flush=True)
            os.abort()
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--proto", default="7")
    ap.add_argument("--die-on", choices=["null-node", "get-tensor"], default="null-node")
    ap.add_argument("--startup-delay", type=float, default=0.0)
    args = ap.parse_args()
    time.sleep(args.startup_delay)
    breaker = AbortOnGetTensor() if args.die_on == "get-tensor" else AbortOnNullNode()
    proto = parse_version_option(args.proto)
    with running_server(proto) as ref:
        relay = FaultyServer(ref.address, proto, breaker, port=args.port).start()
        print(f"fragile server for protocol {proto.label} on 127.0.0.1:{args.port}", flush=True)
        threading.Event().wait()
        relay.stop()


if __name__ == "__main__":
    main()
