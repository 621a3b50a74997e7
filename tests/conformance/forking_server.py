"""A line-protocol server for the fork server's tests: one connection at a time, one process, one thread.

``python forking_server.py PORT [--thread]`` listens on 127.0.0.1:PORT and answers each line of a connection:

* ``count``: ``SERVED PID`` -- connections this process has accepted, and its pid (state a fresh copy does not have);
* ``say TEXT``: prints TEXT on stdout, answers ``ok``;
* ``crash``: prints ``about to crash`` and dies of SIGSEGV;
* ``asan``: prints an AddressSanitizer report (tests/fuzz/sanitizer_reports) and exits with code 1, as ASan does;
* ``exit N``: exits with code N;
* ``hang``: stops answering (sleeps);

``--thread`` starts a second thread before listening (a fork would not copy it); ``--no-preload`` exits at once
when a library is preloaded, as an AddressSanitizer build does when its runtime is not first.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

REPORT = Path(__file__).resolve().parents[1] / "fuzz" / "sanitizer_reports" / "asan-heap-buffer-overflow.txt"


def main() -> None:
    port = int(sys.argv[1])
    if "--no-preload" in sys.argv[2:] and os.environ.get("LD_PRELOAD"):
        print("==1==ASan runtime does not come first in initial library list", flush=True)
        sys.exit(1)
    if "--thread" in sys.argv[2:]:
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1)
    print(f"forking_server listening on 127.0.0.1:{port}", flush=True)
    served = 0
    while True:
        conn, _ = listener.accept()
        served += 1
        stream = conn.makefile("rwb", buffering=0)
        for raw in stream:
            word, _, rest = raw.decode().strip().partition(" ")
            if word == "count":
                stream.write(f"{served} {os.getpid()}\n".encode())
            elif word == "say":
                print(rest, flush=True)
                stream.write(b"ok\n")
            elif word == "crash":
                print("about to crash", flush=True)
                os.kill(os.getpid(), signal.SIGSEGV)
            elif word == "asan":
                sys.stderr.write(REPORT.read_text())
                sys.stderr.flush()
                os._exit(1)
            elif word == "exit":
                os._exit(int(rest))
            elif word == "hang":
                time.sleep(3600)
        stream.close()
        conn.close()


if __name__ == "__main__":
    main()
