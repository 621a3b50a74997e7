"""An instrumented 8.0.0 (``upstream install --proto 8 --sanitize address``): ggml alone, from Debian's source
package, built with AddressSanitizer and UBSan, served by the kit's own server program.

8.0.0 reaches the kit as prebuilt libraries only (the wheel, Debian's binary packages), and no registry sdist
carries it; Debian's ``ggml`` source package (0.27.0, the same code as ``libggml0``) does. The install:

1. fetches it with ``apt-get source`` under the private apt configuration of :mod:`.debian` (a ``deb-src`` line for
   sid; apt checks every file against the signed index) and unpacks it with ``dpkg-source -x``, Debian's patches
   applied, as Debian builds it (the unpacked tree stays in the prefix: the facts read from it and the reports'
   source lines refer to it);
2. builds ggml alone with CMake: the RPC backend and the CPU backend linked in (no dynamically loaded backends, no
   other device), ggml's own sanitizer options, debug information, shared libraries;
3. compiles the kit's own server program (``rpc_server_main.c``: ggml's source has no server program) against
   the built libraries, with the same sanitizers;
4. checks that it answers HELLO 8.0.0.

Or from a ggml source the user has (``--source DIR|TARBALL``), recorded as such. Never run by CI (minutes of
compiling); the release peers do not need it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from .debian import SUITE, DebianInstallError, apt_update
from .hello import HelloError, server_hello
from .install import InstallError, _run_logged, missing_tools
from .peers import KIT_SERVER, Peer, cache_root

Say = Callable[[str], None]

#: The source package of each version's ggml (name, Debian version).
SOURCES: dict[str, tuple[str, str]] = {"8.0.0": ("ggml", "0.27.0-1")}

#: ggml alone: RPC and the CPU backend linked into the libraries, no other device, no tests or examples, the CPU
#: code for x86-64-v3 (a native build may enable AMX, which these machines report but do not grant); ggml's own
#: sanitizer switches and debug information, so that reports name ggml's functions and lines.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=OFF", "-DGGML_RPC=ON",
    "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_OPENMP=OFF", "-DGGML_BLAS=OFF",
    "-DGGML_VULKAN=OFF", "-DGGML_CUDA=OFF", "-DGGML_HIP=OFF",
)

#: Per sanitizer: ggml's CMake switches and the compiler flags of the kit's program.
SANITIZE_OPTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "address": (("-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON"),
                ("-fsanitize=address,undefined", "-fno-omit-frame-pointer")),
}

_SERVER_SOURCE = "rpc_server_main.c"
_PROTO = re.compile(r"#define\s+RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")
_GGML_VERSION = re.compile(r"set\(GGML_VERSION_(MAJOR|MINOR|PATCH)\s+(\d+)\)")


class SourceBuildError(InstallError):
    """The instrumented build could not be made; the message says why in one line."""


def cmake_options(sanitize: str) -> list[str]:
    return [*CMAKE_OPTIONS, *SANITIZE_OPTIONS[sanitize][0]]


def source_versions(tree: Path) -> tuple[str, str]:
    """(ggml's version, the RPC protocol version) a ggml source tree declares."""
    header = tree / "include" / "ggml-rpc.h"
    cmake = tree / "CMakeLists.txt"
    if not header.is_file() or not cmake.is_file():
        raise SourceBuildError(f"{tree} is not a ggml source tree (no include/ggml-rpc.h or CMakeLists.txt)")
    proto = dict(_PROTO.findall(header.read_text(errors="replace")))
    ggml = dict(_GGML_VERSION.findall(cmake.read_text(errors="replace")))
    join = lambda d: ".".join(d.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))  # noqa: E731
    return join(ggml), join(proto)


def sources_dir() -> Path:
    """Where fetched source packages are kept (a rebuild fetches nothing)."""
    return cache_root() / "sources"


def fetch_source_package(version: str, log: Path, say: Say) -> Path:
    """The source package's ``.dsc`` (downloaded with its files into :func:`sources_dir` unless kept)."""
    name, deb_version = SOURCES[version]
    dsc = sources_dir() / f"{name}_{deb_version.split(':')[-1]}.dsc"
    if dsc.is_file():
        say(f"  using the kept source package {dsc}")
        return dsc
    opts = apt_update(log, say)
    sources_dir().mkdir(parents=True, exist_ok=True)
    say(f"  apt-get source --download-only {name}={deb_version} (Debian {SUITE})")
    with log.open("ab") as out:
        done = subprocess.run(["apt-get", *opts, "source", "--download-only", f"{name}={deb_version}"],
                              cwd=sources_dir(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or not dsc.is_file():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith(("E:", "Err"))][-1:]
        raise SourceBuildError(f"apt-get source {name}={deb_version} failed (exit {done.returncode})"
                               + (f": {tail[0][:200]}" if tail else "") + f"; see {log}")
    return dsc


def unpack(source: Path, dest: Path, log: Path) -> str:
    """Unpack a ``.dsc`` (with ``dpkg-source -x``: Debian's patches applied), a tarball or a copy of a folder into
    ``dest``; returns how (recorded)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", "build*"))
        return f"the folder {source}"
    if source.suffix == ".dsc":
        if shutil.which("dpkg-source") is None:
            raise SourceBuildError("unpacking Debian's source package needs dpkg-source: apt-get install dpkg-dev")
        with log.open("ab") as out:
            done = subprocess.run(["dpkg-source", "--no-check", "-x", str(source), str(dest)], stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise SourceBuildError(f"dpkg-source -x {source.name} failed (exit {done.returncode}); see {log}")
        series = dest / "debian" / "patches" / "series"
        patches = [ln.strip() for ln in series.read_text().splitlines() if ln.strip() and not ln.startswith("#")] \
            if series.is_file() else []
        return f"Debian's source package {source.name}, {len(patches)} Debian patch(es) applied"
    if tarfile.is_tarfile(source):
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(source) as tar:
            tar.extractall(tmp, filter="data")
        tops = list(tmp.iterdir())
        (tops[0] if len(tops) == 1 and tops[0].is_dir() else tmp).rename(dest)
        shutil.rmtree(tmp, ignore_errors=True)
        return f"the tarball {source.name}"
    raise SourceBuildError(f"--source {source}: not a folder, a .dsc or a tarball")


def _run(argv: list[str], log: Path, say: Say, label: str) -> None:
    _run_logged(argv, log, dict(os.environ), say, label)


def build(tree: Path, build_dir: Path, sanitize: str, jobs: int, log: Path, say: Say) -> None:
    """Configure and build ggml alone with the sanitizers' options."""
    shutil.rmtree(build_dir, ignore_errors=True)
    _run(["cmake", "-S", str(tree), "-B", str(build_dir), *cmake_options(sanitize)], log, say, "configure")
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs)], log, say, "build")


def built_libraries(build_dir: Path) -> Path:
    """The folder holding the built ``libggml.so`` (ggml puts its outputs in ``bin/``)."""
    for folder in (build_dir / "bin", build_dir / "src", build_dir):
        if (folder / "libggml.so").exists():
            return folder
    found = sorted(build_dir.rglob("libggml.so"))
    if not found:
        raise SourceBuildError(f"the build made no libggml.so (in {build_dir})")
    return found[0].parent


def compile_server(tree: Path, libs: Path, out: Path, sanitize: str, log: Path) -> None:
    """The kit's server program, against the build's headers and libraries (found at run time by its RUNPATH)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SourceBuildError("no C compiler: apt-get install gcc")
    source = Path(str(resources.files("ggml_rpc.conformance.upstream").joinpath(_SERVER_SOURCE)))
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [cc, "-O1", "-g", "-Wall", *SANITIZE_OPTIONS[sanitize][1], "-I", str(tree / "include"), "-o", str(out),
            str(source), "-L", str(libs), "-lggml", "-lggml-base", f"-Wl,-rpath,{libs}"]
    with log.open("ab") as f:
        f.write(f"$ {' '.join(argv)}\n".encode())
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SourceBuildError(f"compiling {_SERVER_SOURCE} failed (exit {done.returncode}); see {log}")


def install_instrumented(peer: Peer, *, say: Say = print, jobs: int | None = None, force: bool = False,
                         source: Path | None = None) -> dict[str, object]:
    """Build the instrumented ``peer`` (kind ``ggml``) unless it is installed already; returns its record."""
    if peer.installed() and not force:
        info = peer.info()
        say(f"{peer.label}: already installed in {peer.prefix} (built in {info.get('build_seconds', '?')} s)")
        return info
    missing = missing_tools()
    if missing:
        raise SourceBuildError(f"building needs {', '.join(missing)}: apt-get install {' '.join(missing)}")
    peer.prefix.mkdir(parents=True, exist_ok=True)
    log = peer.prefix / "build.log"
    log.write_bytes(b"")
    started = time.monotonic()
    try:
        origin = source if source is not None else fetch_source_package(peer.version, log, say)
    except DebianInstallError as exc:
        raise SourceBuildError(str(exc)) from None
    tree = peer.prefix / "src"
    how = unpack(origin, tree, log)
    ggml_version, proto = source_versions(tree)
    if proto != peer.version:
        raise SourceBuildError(f"{how} is ggml {ggml_version}, protocol {proto}: not {peer.version}")
    n_jobs = jobs or os.cpu_count() or 1
    say(f"  {peer.label}: building ggml {ggml_version} alone with {peer.sanitize} sanitizers, {n_jobs} jobs; log: "
        f"{log}")
    build_started = time.monotonic()
    build(tree, peer.prefix / "build", peer.sanitize, n_jobs, log, say)
    libs = built_libraries(peer.prefix / "build")
    compile_server(tree, libs, peer.bin_dir / KIT_SERVER, peer.sanitize, log)
    build_seconds = round(time.monotonic() - build_started)
    # Recorded before the HELLO: the peer's environment names the library folder from it.
    record: dict[str, object] = {
        "version": peer.version, "kind": "ggml", "sanitize": peer.sanitize, "ggml_version": ggml_version,
        "source": how, "cmake_args": " ".join(cmake_options(peer.sanitize)), "libraries": str(libs),
        "server": f"{KIT_SERVER} (the kit's {_SERVER_SOURCE})", "build_seconds": build_seconds,
    }
    peer.record.write_text(json.dumps(record, indent=2) + "\n")
    try:
        hello = ".".join(map(str, server_hello(peer, log=peer.prefix / "hello.log")))
    except HelloError as exc:
        peer.record.unlink()
        raise SourceBuildError(str(exc)) from None
    if hello != peer.version:
        peer.record.unlink()
        raise SourceBuildError(f"the instrumented server answers HELLO {hello}, expected {peer.version}")
    record.update(hello=hello, install_seconds=round(time.monotonic() - started),
                  built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    peer.record.write_text(json.dumps(record, indent=2) + "\n")
    say(f"{peer.label}: built in {build_seconds} s from {how} (ggml {ggml_version}); its server answers HELLO "
        f"{hello}")
    return record


__all__ = ["CMAKE_OPTIONS", "SOURCES", "SourceBuildError", "cmake_options", "install_instrumented",
           "source_versions"]
