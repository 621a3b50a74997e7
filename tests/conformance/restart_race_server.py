"""A server that dies like upstream does on FRAME-010, and comes back awkwardly: for the death-attribution tests.

``python restart_race_server.py --port N [--state FILE --on-restart serve|blink|exit] [--gap S]`` runs the
reference server (protocol 7) behind a relay on 127.0.0.1:N.

- A GET_TENSOR of a tensor whose data lies outside its buffer aborts the whole process (SIGABRT), as an upstream
  server does on the first step of FRAME-010; reads inside a buffer work (so DATA checks pass after a restart).
- Command 0xEE makes the live process stop listening for ``--gap`` seconds ("alive but not accepting"): the
  listener is closed before the requesting connection is, so the requester's next connect is refused for sure.
- ``--state FILE`` tells a first start from a restart (the file exists).  On a restart, ``blink`` accepts one
  connection (the harness's port probe), then refuses for ``--gap`` seconds before serving; ``exit`` exits at
  once with code 3 (a restart that fails); ``serve`` just serves.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faulty import Act, Breaker, Conn, FaultyServer, Msg
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V7, Command

#: The raw command that makes the server stop listening for a moment (no protocol has it).
BLINK = 0xEE


class Dies(Breaker):
    def __init__(self, port: int, gap: float) -> None:
        self.port = port
        self.gap = gap
        self.relay: FaultyServer | None = None

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        if msg.cmd == Command.GET_TENSOR and msg.fields is not None:
            t = msg.fields["tensor"]
            size, base = conn.buffers.get(t["buffer"], [0, 0])
            if base and not base <= t["data"] < base + size:
                print("fatal: GET_TENSOR outside its buffer, aborting", flush=True)
                os.abort()
        if msg.cmd == BLINK and self.relay is not None:
            self._stop_listening(self.relay)
            threading.Thread(target=self._listen_again, args=(self.relay,), daemon=True).start()
            return Act(forward=None, close=True)
        return None

    @staticmethod
    def _stop_listening(relay: FaultyServer) -> None:
        # shutdown() wakes the accept() blocked in the relay's thread (close() alone does not on Linux).
        with contextlib.suppress(OSError):
            relay.sock.shutdown(socket.SHUT_RDWR)
        relay.sock.close()

    def _listen_again(self, relay: FaultyServer) -> None:
        time.sleep(self.gap)
        relay.sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=relay._accept, daemon=True).start()


def refuse_after_probe(port: int, gap: float) -> None:
    """Accept one connection (a readiness probe) and close it, then refuse connections for ``gap`` seconds."""
    with socket.create_server(("127.0.0.1", port)) as pre:
        conn, _ = pre.accept()
        conn.close()
    time.sleep(gap)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--state", type=Path, default=None)
    ap.add_argument("--on-restart", choices=["serve", "blink", "exit"], default="serve")
    ap.add_argument("--gap", type=float, default=1.0)
    args = ap.parse_args()
    restarted = args.state is not None and args.state.exists()
    if args.state is not None:
        args.state.touch()
    if restarted and args.on_restart == "exit":
        print("restart refused", flush=True)
        sys.exit(3)
    if restarted and args.on_restart == "blink":
        refuse_after_probe(args.port, args.gap)
    breaker = Dies(args.port, args.gap)
    with running_server(V7) as ref:
        relay = FaultyServer(ref.address, V7, breaker, port=args.port)
        breaker.relay = relay
        relay.start()
        print(f"restart-race server on 127.0.0.1:{args.port}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
