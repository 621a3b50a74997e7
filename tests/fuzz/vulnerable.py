"""Deliberately vulnerable reference servers, for tests only: the reference with one bug put back through its hooks.

:data:`ABORTING` re-enables the security checklist's item 16 (conformance/fuzz/checklist.py): upstream 6/7 checks that a
tensor's data lies inside its buffer with an assertion, so a tensor with a valid buffer handle and an address outside
that buffer aborts the whole server process (remote denial of service).  The reference server closes only the
connection; this variant aborts its process instead, exactly as upstream does.  The others break one reply each.
"""

from __future__ import annotations

import os
import shlex
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from ggml_rpc.reference import Hooks, ServerConfig, ServerCore
from ggml_rpc.reference.closing import Close
from ggml_rpc.reference.server import Server
from ggml_rpc.spec import Command, tensor_nbytes
from ggml_rpc.spec.codec import REPLY_HEADER


def _abort_on_buffer_range(exc: Close) -> None:
    if "buffer-range assertion" in str(exc):
        os.abort()


def _silent_max_size(core: ServerCore, f: dict[str, Any]) -> None:
    return None


def _wrong_alignment(core: ServerCore, f: dict[str, Any]) -> None:
    core.resolve.device(f["device"], "GET_ALIGNMENT")
    core.reply(Command.GET_ALIGNMENT, {"alignment": 64})


def _leaky_get_tensor(core: ServerCore, f: dict[str, Any]) -> None:
    size = f["size"]
    if size > 1 << 20:
        raise Close("too large even for a leaky server")
    try:
        core.handlers[Command.GET_TENSOR](f)
    except Close:
        core.send([REPLY_HEADER.pack(size), bytes(size)])


_REPORTS = Path(__file__).resolve().parent / "sanitizer_reports"
#: What an instrumented build prints for these two bugs (GCC's AddressSanitizer and UBSan formats, as the sanitized
#: upstream peers print them); the paths and addresses are made up.
ASAN_REPORT = (_REPORTS / "asan-heap-buffer-overflow.txt").read_text().rstrip("\n")

UBSAN_REPORT = (_REPORTS / "ubsan-signed-integer-overflow.txt").read_text().rstrip("\n")



def _asan_on_buffer_range(exc: Close) -> None:
    if "buffer-range assertion" in str(exc):
        sys.stderr.write(ASAN_REPORT + "\n")
        sys.stderr.flush()
        os._exit(1)  # AddressSanitizer's exit code after a report


def _ubsan_memset(core: ServerCore, f: dict[str, Any]) -> None:
    sys.stderr.write(UBSAN_REPORT + "\n")  # reported, and the server goes on as a recovering UBSan build does
    sys.stderr.flush()
    core.handlers[Command.MEMSET_TENSOR](f)


#: The buffer-range check kills the process (SIGABRT).
ABORTING = Hooks(close=_abort_on_buffer_range)
#: Never answers GET_MAX_SIZE (but goes on reading): the client waits for ever -- a hang.
SILENT_MAX_SIZE = Hooks(handlers={Command.GET_MAX_SIZE: _silent_max_size})
#: Answers GET_ALIGNMENT with 64 where the reference configuration says 32 -- a wrong reply.
WRONG_ALIGNMENT = Hooks(handlers={Command.GET_ALIGNMENT: _wrong_alignment})
#: The buffer-range check dies as an ASan build does: a heap-buffer-overflow report, exit code 1.
ASAN_DEATH = Hooks(close=_asan_on_buffer_range)
#: Every MEMSET_TENSOR prints a UBSan report first, and is then served: the server survives it.
UBSAN_MEMSET = Hooks(handlers={Command.MEMSET_TENSOR: _ubsan_memset})
#: Bytes the planted COPY_TENSOR bug writes past its destination.
PLANTED_BYTES = 16


def _copy_past_end(core: ServerCore, f: dict[str, Any]) -> None:
    """The reference's COPY_TENSOR, then, when the copy ended exactly at its destination buffer's last byte, its
    last PLANTED_BYTES bytes once more at the start of the buffer allocated next on the connection: what a server
    whose copy runs on past the end of a buffer does to the allocation that follows it."""
    core.handlers[Command.COPY_TENSOR](f)
    src, dst = f["src"], f["dst"]
    table = core.table
    sbuf, dbuf = table.get(src["buffer"]), table.get(dst["buffer"])
    if sbuf is None or dbuf is None:
        return
    n = tensor_nbytes(src)
    if not n or dst["data"] + n != dbuf.end:
        return
    handles = list(table.buffers)
    later = handles[handles.index(dbuf.handle) + 1:]
    if not later:
        return
    nxt = table.buffers[later[0]]
    k = min(PLANTED_BYTES, n, nxt.size)
    start = src["data"] - sbuf.base + n - k
    nxt.memory[:k] = sbuf.memory[start : start + k]


#: GET_TENSOR without the region check: reads past a tensor's buffer are answered with whatever follows (here zero
#: bytes standing for neighbouring memory) -- out-of-buffer data in a reply.
LEAKY_GET_TENSOR = Hooks(handlers={Command.GET_TENSOR: _leaky_get_tensor})
#: The planted write bug: a COPY_TENSOR whose destination ends exactly at its buffer's end writes PLANTED_BYTES more
#: bytes into the next buffer (one command, one geometry: destination at-end).
PLANTED_COPY = Hooks(handlers={Command.COPY_TENSOR: _copy_past_end})


def server_with(hooks: Hooks, name: str) -> type[Server]:
    """A reference server class whose connections run with ``hooks``."""

    class Variant(Server):
        def __init__(self, config: ServerConfig, *args: Any, **kwargs: Any) -> None:
            super().__init__(replace(config, hooks=hooks), *args, **kwargs)

    Variant.__name__ = name
    return Variant


#: Serves every connection with :data:`ABORTING`.
VulnerableServer = server_with(ABORTING, "VulnerableServer")
#: Serves every connection with :data:`PLANTED_COPY`.
PlantedServer = server_with(PLANTED_COPY, "PlantedServer")


def command(variant: str = "aborting", *, forkable: bool = True) -> str:
    """The ``--spawn`` command line of a variant. ``forkable``: with one BLAS thread, so that the process has a single
    thread when it first accepts a connection and a death costs a fork (the kit's fork server) rather than a new
    Python process (about 1.5 s each; campaigns restart it over a hundred times). Without it OpenBLAS's second thread
    makes every restart a new process."""
    argv = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__)))} --port {{port}} --variant {variant}"
    return f"env OPENBLAS_NUM_THREADS=1 {argv}" if forkable else argv


def main() -> None:
    """``python vulnerable.py --port N [--proto 7]``: serve the vulnerable variant (for ``ggml-rpc fuzz --spawn``)."""
    import argparse

    from ggml_rpc.conformance.fuzz import fuzz_config
    from ggml_rpc.spec import parse_version_option

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--proto", default="7")
    p.add_argument("--variant", choices=["aborting", "asan", "ubsan"], default="aborting")
    args = p.parse_args()
    warnings.simplefilter("ignore")  # fuzzed numbers through the executor: NaN and overflow are expected
    cls = {"aborting": VulnerableServer, "asan": server_with(ASAN_DEATH, "AsanServer"),
           "ubsan": server_with(UBSAN_MEMSET, "UbsanServer")}[args.variant]
    server = cls(fuzz_config(parse_version_option(args.proto)), "127.0.0.1", args.port)
    print(f"vulnerable reference server listening on 127.0.0.1:{server.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
