"""Fuzz targets: the harness's external and spawned servers, and an embedded reference server that can restart.

The embedded target takes a server class, so tests can fuzz a deliberately broken variant of the reference.

The hash cache: the model can only judge SET_TENSOR_HASH exactly when it knows what the target's cache holds.  It
does for the embedded target with a cache and for an upstream ``rpc-server -c`` the fuzzer spawns itself
(:class:`CachedSpawnedTarget`: ``LLAMA_CACHE`` points at a directory of the fuzzer's, which stays across restarts
and is emptied with the model's cache before every example and every shrink replay).  It cannot for a server it
only connects to, or one spawned with a cache directory the user chose (:func:`cache_unknown`): there a hit where
the model misses is accepted, and the example is judged no further.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import shlex
import signal
import tempfile
import warnings
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.conformance.harness import SpawnedTarget, Target, TargetError, exit_status
from ggml_rpc.reference.config import ServerConfig
from ggml_rpc.reference.server import Server, make_config
from ggml_rpc.spec import DEFAULT_HOST, Protocol

#: Device memory of the embedded target and of the model: small, so a fuzzed BUFFER_CLEAR stays cheap.
FUZZ_DEVICE_MEMORY = 64 << 20


def fuzz_config(protocol: Protocol, *, devices: int = 1, mem: int = FUZZ_DEVICE_MEMORY) -> ServerConfig:
    """The configuration of the embedded target and of the model that judges it."""
    return make_config(protocol, devices=devices, mem=mem)


def _serve(server_cls: type[Server], config: ServerConfig, host: str, conn: Connection) -> None:
    """Child process: listen, say on which port, serve until terminated."""
    # The parent stops this process (SIGTERM: die quietly) and handles Ctrl-C for the whole campaign.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.disable(logging.CRITICAL)
    faulthandler.disable()  # a deliberate abort (test variants) needs no interpreter traceback
    warnings.simplefilter("ignore")  # fuzzed numbers through the executor: NaN and overflow are expected
    np.seterr(all="ignore")
    server = server_cls(config, host, 0)
    conn.send(server.port)
    conn.close()
    server.serve_forever()


class EmbeddedFuzzTarget(Target):
    """A reference server (or a subclass of it) in a child process, with its own hash cache directory.

    A process of its own keeps the target off the fuzzer's interpreter lock (two busy threads of one process
    hand the lock over only every few milliseconds) and makes a crash a real process death.  ``restart`` starts
    a fresh one (on a new port), as a process supervisor would.
    """

    can_restart = True

    def __init__(self, config: ServerConfig, server_cls: type[Server] = Server, *, cache: bool = True,
                 host: str = DEFAULT_HOST) -> None:
        self.config = config
        self.server_cls = server_cls
        self.host = host
        self.use_cache = cache
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.restarts = 0
        # The protocol is not part of the name: the campaign header states it once.
        self.description = "embedded reference server"
        if server_cls is not Server:
            self.description += f" ({server_cls.__name__})"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def cache_dir(self) -> Path | None:
        return Path(self._tmp.name) if self._tmp is not None else None

    def start(self) -> None:
        config = self.config
        if self.use_cache:
            self._tmp = tempfile.TemporaryDirectory(prefix="ggml-rpc-fuzz-target-cache-")
            config = replace(config, cache_dir=self._tmp.name)
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_serve, args=(self.server_cls, config, self.host, child),
                                name="ggml-rpc-fuzz-target", daemon=True)
        self.proc.start()
        child.close()
        if not parent.poll(20):
            self.stop()
            raise TargetError("the embedded server did not start")
        self.port = parent.recv()
        parent.close()

    def process_exited(self) -> bool:
        return self.proc is not None and not self.proc.is_alive()

    def death_info(self) -> dict[str, Any] | None:
        proc = self.proc
        if proc is None:
            return None
        proc.join(2.0)  # a dying process (core dump) takes a moment to be reaped
        if proc.is_alive():
            return {"status": "still running but not answering", "log_tail": []}
        code = proc.exitcode
        status = exit_status(code) if code is not None else "exit code unknown"
        return {"status": status, "exit_code": code, "log_tail": []}

    def stop(self) -> None:
        proc = self.proc
        if proc is not None:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
            proc.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()


#: Options that start a server with a hash cache: upstream ``rpc-server -c`` / ``--cache``, the kit's
#: ``ggml-rpc serve --cache-dir DIR``.
_UPSTREAM_CACHE_FLAGS = ("-c", "--cache")
_CACHE_DIR_FLAG = "--cache-dir"


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


class FuzzSpawnedTarget(SpawnedTarget):
    """A server the fuzzer starts (and restarts after every death) with a few environment variables of its own.

    ``GGML_NO_BACKTRACE=1`` (unless the user set it): upstream otherwise attaches gdb to print a backtrace at every
    abort, which costs seconds per death and pushes the assertion's ``file:line`` (part of a finding's class) out
    of the log tail the fuzzer keeps. With ``fork_server`` (the default) a death costs a fork of the server as it
    was when it first accepted a connection, not a process start (see :class:`SpawnedTarget`).
    """

    def __init__(self, command: str, env: dict[str, str] | None = None, *, fork_server: bool = True,
                 **kwargs: Any) -> None:
        env = {"GGML_NO_BACKTRACE": os.environ.get("GGML_NO_BACKTRACE", "1"), **(env or {})}
        super().__init__(command, env=env, fork_server=fork_server, **kwargs)


class CachedSpawnedTarget(FuzzSpawnedTarget):
    """An upstream ``rpc-server -c`` started with ``LLAMA_CACHE`` set to a directory of the fuzzer's own.

    Upstream keeps its cache files in ``$LLAMA_CACHE/rpc/`` (named as spec/PROTOCOL.md#hash says); the directory
    outlives restarts (as a real one would), so the fuzzer empties it, and the model's cache, before each example and
    each replay.
    """

    use_cache = True

    def __init__(self, command: str, **kwargs: Any) -> None:
        # Not removed by stop(), which every restart calls: the directory goes with this object (or at exit).
        self._base = tempfile.TemporaryDirectory(prefix="ggml-rpc-fuzz-llama-cache-")
        super().__init__(command, {"LLAMA_CACHE": self._base.name}, cache_dir=Path(self._base.name) / "rpc",
                         **kwargs)
        self.description = f"spawned: {command} (LLAMA_CACHE={self._base.name})"

    def start(self) -> None:
        super().start()
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)


def spawned_target(command: str, *, fork_server: bool = True) -> FuzzSpawnedTarget:
    """The target for ``--spawn CMD``: an upstream server started with ``-c`` gets a cache the fuzzer can follow;
    ``fork_server``: restarts are forks when the server allows it."""
    words = _words(command)
    if any(w in _UPSTREAM_CACHE_FLAGS for w in words[1:]) and _CACHE_DIR_FLAG not in words:
        return CachedSpawnedTarget(command, fork_server=fork_server)
    return FuzzSpawnedTarget(command, fork_server=fork_server)


def cache_unknown(target: Target) -> bool:
    """May the target hold hash cache entries the model cannot know of (a server the fuzzer only connects to, or
    one spawned with a cache directory the user chose)?"""
    if isinstance(target, EmbeddedFuzzTarget | CachedSpawnedTarget):
        return False
    if isinstance(target, SpawnedTarget):
        words = _words(target.command)[1:]
        return any(w in _UPSTREAM_CACHE_FLAGS or w.split("=", 1)[0] == _CACHE_DIR_FLAG for w in words)
    return True
