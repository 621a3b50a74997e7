"""The rich console the commands print their tables through."""

from __future__ import annotations

import sys
import time

from rich.console import Console


class PipeConsole(Console):
    """A console for which a closed standard output (``ggml-rpc check | head``) ends the command like any other
    closed pipe: the ``ggml-rpc`` entry turns the BrokenPipeError into exit code 0 (rich on its own exits with 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("standard output was closed by its reader")


def ready_kernels() -> None:
    """Have the reference executor's compiled kernels ready before the command starts a server or computes a
    reference result: on a machine's first run they are compiled (a minute or two, said on standard error), on every
    later one loaded from numba's cache.  Whatever the command then judges, it never waits for a compile (a check's
    timeout would otherwise measure the kit's own warm-up)."""
    from ggml_rpc.reference import warm_up

    started: list[float] = []

    def compiling() -> None:
        started.append(time.monotonic())
        print("ggml-rpc: compiling the reference executor's kernels for this machine (first run only, a minute or "
              "two; later runs load them from numba's cache)", file=sys.stderr, flush=True)

    warm_up(compiling)
    if started:
        print(f"ggml-rpc: kernels compiled in {time.monotonic() - started[0]:.0f} s", file=sys.stderr, flush=True)
