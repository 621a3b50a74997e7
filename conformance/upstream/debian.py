"""Debian's own build of protocol 8.0.0 as a peer: sid's packages, fetched and run privately.

Debian sid ships ggml 0.27.0 (``libggml0``, ``libggml0-backend-rpc``) and llama.cpp 0.7.0 (``llama.cpp-tools``,
``llama.cpp-tools-extra``, ``libllama0``): ``ggml-rpc-server`` answers HELLO 8.0.0. Nothing is installed
system-wide. A private apt configuration (its own sources file for sid on the machine's Debian mirror, its own
lists, cache, state and preferences; the system's apt state is neither read nor written) downloads the exact
package versions and sid's C runtime, which ``dpkg-deb -x`` unpacks into the peer's ``root/``. Every program then
runs through that tree's own loader with ``--library-path`` naming only the tree (:meth:`Peer.command`).

ggml there loads its backends (the RPC client and one CPU library per instruction set) from a directory compiled
into ``libggml`` as an absolute system path. It also searches the folder of the running executable, which for a
program started through the loader is the loader's own folder: the install links every backend there, inside the
private tree, so the programs find them without any change under ``/usr``, any privilege, or any preload. A
machine that has Debian's ``libggml0`` installed system-wide has that system directory too, searched first: the
install records it (``system_backends``), since the system's backends then win ties.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .hello import HelloError, server_hello
from .install import InstallError
from .peers import DEBIAN_BIN, LOADER_NAME, RUNTIME_LIBDIR, Peer, cache_root
from .wheel import already_installed, install_vocab

Say = Callable[[str], None]

#: The suite the packages come from and the keyring that verifies it (Debian's archive keys, on every Debian).
SUITE = "sid"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
#: Used when the machine's own apt sources name no Debian mirror.
DEFAULT_MIRROR = "http://deb.debian.org/debian"

#: The exact packages of each version's build: the server, the clients, their libraries (and ggml's headers, which
#: programs of the kit's own compile against).
PACKAGES: dict[str, dict[str, str]] = {
    "8.0.0": {
        "libggml0": "0.27.0-1", "libggml0-backend-rpc": "0.27.0-1", "libggml-dev": "0.27.0-1",
        "libllama0": "1:0.7.0+dfsg-2",
        "llama.cpp-tools": "1:0.7.0+dfsg-2", "llama.cpp-tools-extra": "1:0.7.0+dfsg-2",
    },
}

#: sid's C and C++ runtime and the libraries the programs link beyond their own (libssl for llama's HTTP code,
#: zlib and zstd for libssl): the versions sid has at install time, recorded in ``peer.json``.
RUNTIME_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1", "libgomp1", "libssl3t64", "zlib1g", "libzstd1")

#: Where libggml looks for its backends, compiled in; only recorded (a system-wide libggml0 has it).
SYSTEM_BACKENDS = Path("/usr/lib/x86_64-linux-gnu/ggml/backends0")
#: The same folder inside the unpacked tree.
BACKENDS = Path("usr/lib/x86_64-linux-gnu/ggml/backends0")

#: Programs whose libraries must all resolve inside the tree (the server, the clients the matrix runs).
CHECKED_PROGRAMS = ("llama-completion", "llama-quantize")

_STARTED = re.compile(r"Starting RPC server v(\d+\.\d+\.\d+)")


class DebianInstallError(InstallError):
    """Debian's packages could not be fetched, unpacked or started; the message says why in one line."""


def system_mirror(sources: Sequence[str]) -> str:
    """The Debian mirror the machine's apt uses: the first ``URIs:`` (deb822) or ``deb`` line URI of ``sources``
    (the texts of its sources files) that serves the Debian archive itself (not security, not another vendor)."""
    for text in sources:
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("#"):
                continue
            uris: list[str] = []
            if line.startswith("URIs:"):
                uris = line.split()[1:]
            elif line.startswith("deb "):
                uris = re.sub(r"\[[^]]*\]", " ", line[4:]).split()[:1]  # past the [options]
            for uri in uris:
                if re.search(r"/debian/?$", uri) and "security" not in uri:
                    return uri.rstrip("/")
    return DEFAULT_MIRROR


def _system_sources() -> list[str]:
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix in (".list", ".sources") and path.is_file():
            try:
                texts.append(path.read_text(errors="replace"))
            except OSError:
                continue
    return texts


def apt_root() -> Path:
    """The private apt configuration's folder, shared by the binary and the source installs (lists kept)."""
    return cache_root() / "apt" / SUITE


def write_apt_config(root: Path, mirror: str, *, keyring: str = KEYRING) -> Path:
    """Write the private configuration under ``root``: a sources file for sid (binaries and sources), empty
    preferences and an empty dpkg status (nothing of the system's pins or installed set is read). Returns the
    sources file."""
    for sub in ("etc/sources.list.d", "etc/preferences.d", "lists/partial", "cache/archives/partial", "state"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    status = root / "state" / "status"
    if not status.exists():
        status.write_text("")
    sources = root / "etc" / "sources.list.d" / f"{SUITE}.sources"
    sources.write_text(f"Types: deb deb-src\nURIs: {mirror}\nSuites: {SUITE}\nComponents: main\n"
                       f"Signed-By: {keyring}\n")
    return sources


def apt_options(root: Path) -> list[str]:
    """``apt-get`` options that make it read only the private configuration under ``root`` and keep its lists,
    cache and state there: no file of the system's apt is read (beyond apt's own defaults) or written, no lock."""
    return ["-o", "Dir::Etc::SourceList=/dev/null", "-o", f"Dir::Etc::SourceParts={root / 'etc/sources.list.d'}",
            "-o", "Dir::Etc::Preferences=/dev/null", "-o", f"Dir::Etc::PreferencesParts={root / 'etc/preferences.d'}",
            "-o", f"Dir::State={root / 'state'}", "-o", f"Dir::State::Lists={root / 'lists'}",
            "-o", f"Dir::State::status={root / 'state/status'}", "-o", f"Dir::Cache={root / 'cache'}",
            "-o", "Debug::NoLocking=1", "-o", "APT::Sandbox::User=root"]


def _run(argv: list[str], log: Path, *, cwd: Path | None = None, what: str) -> str:
    with log.open("ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        done = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, cwd=cwd)
        out.write(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise DebianInstallError(f"{what} failed (exit {done.returncode}): {tail[0][:200]}; see {log}")
    return done.stdout.decode(errors="replace")


def apt_update(log: Path, say: Say) -> list[str]:
    """Refresh the private lists of sid; returns the ``apt-get`` options to use them."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise DebianInstallError(f"Debian's packages need {tool} (a Debian or Debian-based system)")
    if not Path(KEYRING).is_file():
        raise DebianInstallError(f"no Debian archive keyring at {KEYRING}: apt-get install debian-archive-keyring")
    root = apt_root()
    mirror = system_mirror(_system_sources())
    write_apt_config(root, mirror)
    say(f"  refreshing the private package lists of Debian {SUITE} from {mirror} (in {root})")
    opts = apt_options(root)
    _run(["apt-get", *opts, "update"], log, what=f"apt-get update ({SUITE})")
    return opts


def link_backends(tree: Path) -> list[str]:
    """Link every backend library into the loader's folder of ``tree`` (see the module's text); returns their
    names. Relative links: the tree can move."""
    loader_dir = tree / RUNTIME_LIBDIR
    names = []
    for lib in sorted((tree / BACKENDS).glob("libggml-*.so")):
        link = loader_dir / lib.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(lib, loader_dir))
        names.append(lib.name)
    return names


def outside_libraries(listing: str, tree: Path) -> list[str]:
    """The libraries of a loader's ``--list`` output that resolve outside ``tree`` (or not at all)."""
    bad = []
    for line in listing.splitlines():
        line = line.strip()
        if "=>" not in line:
            continue  # the vDSO, the loader itself
        name, _, where = line.partition("=>")
        path = where.strip().split(" (")[0].strip()
        if path == "not found" or not os.path.abspath(path).startswith(str(tree) + os.sep):
            bad.append(f"{name.strip()} => {path}")
    return bad


def check_libraries(peer: Peer) -> None:
    """Every program the kit runs and every backend finds all its libraries inside the tree."""
    tree = peer.runtime_dir
    files = [peer.rpc_server, *(tree / DEBIAN_BIN / p for p in CHECKED_PROGRAMS),
             *sorted((tree / BACKENDS).glob("*.so"))]
    for path in files:
        if not path.is_file():
            raise DebianInstallError(f"the unpacked packages have no {path.relative_to(tree)}")
        done = subprocess.run([*peer.command(path)[:3], "--list", str(path)], capture_output=True, text=True,
                              timeout=60)
        bad = outside_libraries(done.stdout, tree) if done.returncode == 0 else [done.stderr.strip()[:200]]
        if bad:
            raise DebianInstallError(f"{path.name} needs libraries outside the private tree: {', '.join(bad)}")


def fetch_packages(peer: Peer, opts: list[str], log: Path, say: Say) -> list[str]:
    """Download and unpack the packages into the peer's tree; returns ``name=version`` of each."""
    pins = PACKAGES[peer.version]
    wanted = [f"{name}={version}" for name, version in pins.items()] + list(RUNTIME_PACKAGES)
    say(f"  {peer.label}: apt-get download {' '.join(wanted)}")
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-debs-") as tmp:
        _run(["apt-get", *opts, "download", *wanted], log, cwd=Path(tmp), what="apt-get download")
        debs = sorted(Path(tmp).glob("*.deb"))
        if len(debs) != len(wanted):
            raise DebianInstallError(f"apt-get downloaded {len(debs)} of {len(wanted)} packages; see {log}")
        staging = peer.runtime_dir.with_name(peer.runtime_dir.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        got = []
        for deb in debs:
            fields = _run(["dpkg-deb", "-f", str(deb), "Package", "Version"], log, what=f"dpkg-deb -f {deb.name}")
            info = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
            got.append(f"{info['Package']}={info['Version']}")
            _run(["dpkg-deb", "-x", str(deb), str(staging)], log, what=f"dpkg-deb -x {deb.name}")
    for name, version in pins.items():
        if f"{name}={version}" not in got:
            raise DebianInstallError(f"apt-get gave {[g for g in got if g.startswith(name + '=')]} for {name}, "
                                     f"expected {version}")
    if not (staging / RUNTIME_LIBDIR / LOADER_NAME).is_file():
        raise DebianInstallError(f"the unpacked libc6 has no loader at {RUNTIME_LIBDIR / LOADER_NAME}")
    shutil.rmtree(peer.runtime_dir, ignore_errors=True)
    staging.rename(peer.runtime_dir)
    return got


def started_line(log: str) -> str | None:
    """The version the server's own start-up line names (``Starting RPC server v8.0.0``)."""
    m = _STARTED.search(log)
    return m.group(1) if m else None


def install_debian_peer(peer: Peer, *, say: Say = print, force: bool = False) -> dict[str, object]:
    """Install Debian's build of ``peer.version`` unless it is installed already; returns its record."""
    if peer.installed() and not force:
        return already_installed(peer, peer.requirement, say)
    peer.prefix.mkdir(parents=True, exist_ok=True)
    log = peer.prefix / "install.log"
    log.write_bytes(b"")
    started = time.monotonic()
    opts = apt_update(log, say)
    got = fetch_packages(peer, opts, log, say)
    linked = link_backends(peer.runtime_dir)
    check_libraries(peer)
    vocab = install_vocab(peer)
    server_log = peer.prefix / "hello.log"
    try:
        hello = ".".join(map(str, server_hello(peer, log=server_log)))
    except HelloError as exc:
        raise DebianInstallError(str(exc)) from None
    announced = started_line(server_log.read_text(errors="replace"))
    if hello != peer.version or announced != peer.version:
        raise DebianInstallError(f"{peer.rpc_server.name} answers HELLO {hello} and starts as v{announced}, "
                                 f"expected {peer.version}; see {server_log}")
    seconds = round(time.monotonic() - started)
    record: dict[str, object] = {
        "version": peer.version, "kind": "debian", "origin": "debian", "package": peer.requirement,
        "suite": SUITE, "mirror": system_mirror(_system_sources()), "packages": got, "hello": hello,
        "started": f"Starting RPC server v{announced}", "install_seconds": seconds, "build_seconds": None,
        "runs": {"loader": str(peer.loader), "library_path": [str(p) for p in peer.library_path],
                 "backends_linked": linked},
        "system_backends": str(SYSTEM_BACKENDS) if SYSTEM_BACKENDS.is_dir() else None,
        "vocab": vocab, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    peer.record.write_text(json.dumps(record, indent=2) + "\n")
    say(f"{peer.label}: installed in {peer.prefix} in {seconds} s ({', '.join(got[:5])}…); its server answers "
        f"HELLO {hello} (\"Starting RPC server v{announced}\"); vocabulary: {vocab}")
    if record["system_backends"]:
        say(f"  note: {SYSTEM_BACKENDS} exists (Debian's libggml0 is installed system-wide); ggml searches it "
            "before the private tree")
    return record


__all__ = ["PACKAGES", "RUNTIME_PACKAGES", "DebianInstallError", "apt_options", "install_debian_peer",
           "link_backends", "outside_libraries", "started_line", "system_mirror", "write_apt_config"]
