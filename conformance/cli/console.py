"""The rich console the commands print their tables through."""

from __future__ import annotations

from rich.console import Console


class PipeConsole(Console):
    """A console for which a closed standard output (``ggml-rpc check | head``) ends the command like any other
    closed pipe: the ``ggml-rpc`` entry turns the BrokenPipeError into exit code 0 (rich on its own exits with 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("standard output was closed by its reader")
