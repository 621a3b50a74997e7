"""Recording a genuine split session whole, the servers' own link included (``ggml-rpc upstream record-split``).

A proxy sees only client connections; with tensor split (8.0.0) the two servers also talk to each other on rank 0's
port + 1000.  This records the loopback interface with ``dumpcap`` (Wireshark's capture tool, installed with
tshark; capturing needs root or the capture capability), filtered to the two servers' ports and that link port, while
the genuine client splits a tiny model over two genuine servers.  Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .models import ensure_models
from .peers import Peer
from .runs import Finished, UpstreamServer, split_completion

#: The port offset genuine clients choose for the servers' link (rank 0's RPC port + 1000).
LINK_PORT_OFFSET = 1000


class RecordError(Exception):
    """The recording could not be made (the message says why)."""


def dumpcap() -> str:
    path = shutil.which("dumpcap")
    if path is None:
        raise RecordError("dumpcap is not installed (apt-get install tshark installs it)")
    return path


def record_split(peer: Peer, model: str, split: str, out: Path, *, settle: float = 1.0) -> Finished:
    """Record ``peer``'s client splitting ``model`` by ``split`` over two genuine servers into ``out``."""
    tool = dumpcap()
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-record-") as tmp:
        models = ensure_models(Path(tmp) / "models", peer.vocab, [model])
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(UpstreamServer(peer, cache=False)) for _ in range(2)]
            ports = [s.port for s in servers] + [servers[0].port + LINK_PORT_OFFSET]
            bpf = " or ".join(f"tcp port {p}" for p in ports)
            # A large kernel buffer: loopback moves 64 KiB segments faster than a default 2 MiB buffer drains.
            cap = subprocess.Popen([tool, "-i", "lo", "-B", "512", "-f", bpf, "-w", str(out), "-P"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(settle)  # dumpcap opens the interface before the first packet must be seen
            if cap.poll() is not None:
                err = cap.stderr.read().decode(errors="replace").strip().splitlines() if cap.stderr else []
                raise RecordError(f"dumpcap could not capture on lo: {err[0] if err else f'exit {cap.returncode}'}")
            try:
                done = split_completion(peer, models[model], [s.address for s in servers], split)
                time.sleep(settle)  # the last segments reach the capture
            finally:
                cap.terminate()
                cap.wait(timeout=10)
            report = cap.stderr.read().decode(errors="replace") if cap.stderr else ""
    if not done.ok:
        raise RecordError(f"the client failed: {done.why()}")
    # dumpcap's closing line: "Packets received/dropped on interface 'lo': R/D (pcap:P/dumpcap:C/flushed:F/...)".
    counts = re.search(r"received/dropped on interface '[^']*':\s*(\d+)/(\d+) "
                       r"\(pcap:(\d+)/dumpcap:(\d+)/flushed:(\d+)", report)
    if counts is None:
        raise RecordError("dumpcap did not say how many packets it received and dropped")
    lost = sum(int(n) for n in counts.groups()[1:])
    if lost:
        raise RecordError(f"the capture lost {lost} packet(s): record again on a quieter machine")
    return done


__all__ = ["LINK_PORT_OFFSET", "RecordError", "dumpcap", "record_split"]
