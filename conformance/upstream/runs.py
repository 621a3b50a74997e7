"""Running upstream programs for the interop matrix: servers on loopback, llama-completion, the kit's own CLI.

Every process has a bound run time; every server binds 127.0.0.1 and, for upstream, gets a temporary
``LLAMA_CACHE`` so that a run never touches the user's own cache.
"""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ggml_rpc.conformance.harness import exit_status, free_port, wait_for_port

from .peers import LOOPBACK, Peer

#: The generation every completion row runs: greedy, seeded, 32 tokens (enough decode steps for a drift in one
#: op's rounding to reach the text).
PROMPT = "Hello world"
N_PREDICT = 32


@dataclass
class Finished:
    """A program that ran to its end (or was stopped at its time limit)."""

    argv: list[str]
    code: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.code == 0

    def why(self) -> str:
        """One line on how it ended: the exit status and the last line of its error output."""
        status = "timed out" if self.code is None else exit_status(self.code)
        tail = reason_line(self.stderr)
        return f"{self.program} {status}" + (f": {tail}" if tail else "")

    @property
    def program(self) -> str:
        """The program's name; for ``python -m module command`` (a wheel peer's entry point, possibly started
        through a loader) the module and its command rather than the loader's or the interpreter's name."""
        if "-m" in self.argv[:-1]:
            at = self.argv.index("-m")
            return " ".join(a.rsplit(".", 1)[-1] for a in self.argv[at + 1:at + 3])
        if self.argv[1:2] == ["--library-path"]:  # a program started through a private loader (Peer.command)
            return Path(self.argv[3]).name
        return Path(self.argv[0]).name


_REASON = ("mismatch", "rpc server", "failed to", "error")


def reason_line(text: str) -> str:
    """The line of a program's error output that says why it stopped (the last one naming an error)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(word in line.lower() for word in _REASON):
            return line[:200]
    return lines[-1][:200] if lines else ""


def abort_reason(stderr: str) -> str:
    """A client's abort message, comparable between runs: its last ``FILE.cpp:LINE:`` line without the log's
    prefix (upstream's logger puts ``0.00.006.546 E`` or just the time in front when the line goes through its log
    thread, nothing when it aborts at once: the same refusal was printed all three ways, so whatever precedes the
    source location is dropped), the build path, the line number and the port."""
    import re

    aborts = [ln for ln in stderr.splitlines() if re.search(r"\.cpp:\d+: ", ln)]
    line = aborts[-1] if aborts else reason_line(stderr)
    text = re.sub(r"^.*?\S*\.cpp:\d+:\s*", "", line)
    return re.sub(r"127\.0\.0\.1:\d+", "SERVER", text)


def run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 300.0) -> Finished:
    import time

    started = time.monotonic()
    try:
        p = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        code: int | None = p.returncode
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = None, exc.stdout or b"", exc.stderr or b""
    return Finished(argv, code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                    time.monotonic() - started)


def kit(*args: str, timeout: float = 900.0) -> Finished:
    """The kit's own CLI in a child process, exactly as a user runs it."""
    return run([sys.executable, "-m", "ggml_rpc.conformance.cli", *args], timeout=timeout)


def completion_argv(peer: Peer, model: Path, rpc: str | None, *, prompt: str = PROMPT, n_predict: int = N_PREDICT,
                    ignore_eos: bool = False) -> list[str]:
    """Upstream ``llama-completion``: greedy and seeded, all layers on the RPC device when one is given
    (``ignore_eos``: exactly ``n_predict`` tokens, as a speed figure needs)."""
    argv = peer.command(peer.llama_completion, "-m", str(model), "-p", prompt, "-n", str(n_predict), "-no-cnv",
                        "--temp", "0", "-s", "1", "-c", "256", "-t", "1", "--no-warmup",
                        *(["--ignore-eos"] if ignore_eos else []))
    return [*argv, "-ngl", "99", "--rpc", rpc] if rpc else [*argv, "-ngl", "0"]


def completion(peer: Peer, model: Path, rpc: str | None, timeout: float = 300.0) -> Finished:
    """The completion row's generation through ``rpc`` (None: CPU only): upstream ``llama-completion``, or, for a
    wheel peer, the kit's ``generate`` entry point on the wheel's libraries. Either prints the prompt and the
    generated text on stdout (see :func:`generated_text`)."""
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-") as cache:
        argv = peer.generate_argv(model, rpc, n_predict=N_PREDICT) if peer.kind == "wheel" \
            else completion_argv(peer, model, rpc)
        return run(argv, env=peer.env({"LLAMA_CACHE": cache}), timeout=timeout)


def split_completion(peer: Peer, model: Path, rpc: Sequence[str], split: str = "layer",
                     timeout: float = 300.0) -> Finished:
    """The same generation with the model split over several servers (``rpc``: their addresses) by ``split``:
    ``layer`` (whole layers per server) or ``tensor`` (each weight cut across them; 8.0.0 and later, where the
    servers also talk to each other directly). Output as :func:`completion`'s."""
    if split not in ("layer", "tensor"):
        raise ValueError(f"unknown split {split!r} (layer or tensor)")
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-") as cache:
        if peer.kind == "wheel":
            argv = peer.generate_argv(model, list(rpc), split=split, n_predict=N_PREDICT)
        else:
            argv = [*completion_argv(peer, model, ",".join(rpc)), "-sm", split]
        return run(argv, env=peer.env({"LLAMA_CACHE": cache}), timeout=timeout)


class UpstreamServer:
    """Upstream ``rpc-server`` (a wheel peer: the kit's ``serve`` entry point on its libraries) on a free loopback
    port, with its own temporary ``LLAMA_CACHE``; with ``cache``, its hash cache is :attr:`cache_dir`."""

    def __init__(self, peer: Peer, *, cache: bool, llama_cache: Path | None = None) -> None:
        self.peer = peer
        self.cache = cache
        self._given = llama_cache
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def llama_cache(self) -> Path:
        assert self._given is not None or self._tmp is not None
        return self._given if self._given is not None else Path(self._tmp.name)  # type: ignore[union-attr]

    @property
    def cache_dir(self) -> Path:
        """Where upstream keeps its hash cache: ``$LLAMA_CACHE/rpc``."""
        return self.llama_cache / "rpc"

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def spawn_command(self) -> str:
        """A ``--spawn`` command line for ``ggml-rpc check`` (``{port}`` left for the harness)."""
        import shlex

        pre = ["env", *(f"{k}={v}" for k, v in self.peer.launch_env({"LLAMA_CACHE": str(self.llama_cache)}).items())]
        return shlex.join([*pre, *self._argv("{port}")]).replace("'{port}'", "{port}")

    def _argv(self, port: int | str) -> list[str]:
        # upstream's rpc-server -c derives $LLAMA_CACHE/rpc itself; the wheel peer's server is told that folder.
        return self.peer.server_argv(port, cache=self.cache, cache_dir=self.cache_dir if self.cache else None)

    def __enter__(self) -> UpstreamServer:
        if self._given is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-")
        self.port = free_port(LOOPBACK)
        self.proc = subprocess.Popen(self._argv(self.port),
                                     env=self.peer.env({"LLAMA_CACHE": str(self.llama_cache)}),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_for_port(LOOPBACK, self.port, 20.0, lambda: self.proc.poll() is None):  # type: ignore[union-attr]
            self.__exit__(None, None, None)
            raise RuntimeError(f"upstream {self.peer.version} server did not listen on {self.address}")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            end_process(self.proc, 5.0)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def end_process(proc: subprocess.Popen, grace: float) -> None:
    """Ask a server the kit started to stop (SIGTERM), and kill it if it is still there after ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def reference_server(major: int, cache_dir: Path | None) -> Iterator[str]:
    """The kit's reference server, in a child process (as a user runs it), on a free loopback port."""
    port = free_port(LOOPBACK)
    argv = [sys.executable, "-m", "ggml_rpc.conformance.cli", "serve", "--host", LOOPBACK, "--port", str(port),
            "--proto", str(major)]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Its log (a line per connection) is read as it comes, keeping the last lines: a pipe nobody reads fills after
    # some hundred connections and then blocks the server mid-log (test-backend-ops opens that many).
    tail: collections.deque[bytes] = collections.deque(maxlen=50)
    drain = threading.Thread(target=lambda: tail.extend(iter(proc.stderr.readline, b"")),  # type: ignore[union-attr]
                             daemon=True, name="reference-server-log")
    drain.start()
    try:
        if not wait_for_port(LOOPBACK, port, 30.0, lambda: proc.poll() is None):
            why = b"".join(tail).decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"reference server did not listen on {LOOPBACK}:{port}: {why[0]}")
        yield f"{LOOPBACK}:{port}"
    finally:
        end_process(proc, 10.0)
        drain.join(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()


def generated_text(out: str) -> str:
    """What llama-completion printed of the generation (its stdout: the prompt and the new tokens)."""
    return out.strip()
