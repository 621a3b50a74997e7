"""Install a wheel peer (protocol 8.0.0): the registry wheel, a newer C runtime when the system's is too old, a
vocabulary for the tiny models, and a HELLO check. No compiler: minutes, not tens of minutes.

The wheel's libraries need glibc >= 2.38. On an older system (Debian 12 has 2.36) they run unchanged through Debian
13's loader: its ``libc6``, ``libstdc++6``, ``libgcc-s1`` and ``libgomp1`` are fetched with ``apt-get download``
under a private apt configuration (nothing installed system-wide, nothing under ``/etc`` changed) and unpacked into
the peer's ``runtime/``. Every program of the peer is then started as ``runtime/…/ld-linux-x86-64.so.2
--library-path … python -m <the kit's entry module>`` (:meth:`Peer.wheel_argv`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .hello import HelloError, server_hello
from .models import write_test_vocab
from .peers import COMMITS, PEERS, RUNTIME_LIBDIR, SYNTHETIC_VOCAB, WHEEL_ENTRY, Peer, libpython_dir, python_program

Say = Callable[[str], None]

#: The oldest glibc the wheel's libraries load with (their highest GLIBC_ symbol version).
MIN_GLIBC = (2, 38)

#: The Debian release whose C runtime is borrowed, and the packages taken from it.
RUNTIME_SUITE = "trixie"
RUNTIME_MIRROR = "http://deb.debian.org/debian"
RUNTIME_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
RUNTIME_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1", "libgomp1")

#: Tokens of the synthetic vocabulary written when no upstream one is at hand: the real vocabulary's count, so
#: that the models keep their sizes (and the big one stays above the hash threshold).
SYNTHETIC_TOKENS = 32000


class WheelInstallError(Exception):
    """The wheel peer could not be installed; the message says why in one line."""


def glibc_version(text: str | None = None) -> tuple[int, int] | None:
    """The system C library's version (``os.confstr('CS_GNU_LIBC_VERSION')``, e.g. ``glibc 2.36``), or ``text``
    parsed the same way; None when it is not glibc or cannot be read."""
    if text is None:
        try:
            text = os.confstr("CS_GNU_LIBC_VERSION")
        except (ValueError, OSError):
            return None
    if not text or not text.startswith("glibc "):
        return None
    try:
        major, minor = text.split()[1].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def needs_private_runtime(version: tuple[int, int] | None = None) -> bool:
    """Whether the wheel's libraries need the borrowed runtime: glibc older than :data:`MIN_GLIBC` (a system whose
    C library cannot be read is assumed old: the borrowed loader works on any x86-64 Linux)."""
    if version is None:
        version = glibc_version()
    return version is None or version < MIN_GLIBC


def _run(argv: list[str], log: Path, *, cwd: Path | None = None, what: str) -> None:
    with log.open("ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd).returncode
    if code != 0:
        raise WheelInstallError(f"{what} failed (exit {code}); see {log}")


def apt_options(root: Path) -> list[str]:
    """``apt-get`` options that make it read only the private sources in ``root/etc`` and keep its lists and
    cache under ``root``: nothing of the system's apt state is read or written, no lock is taken."""
    return ["-o", "Dir::Etc::SourceList=/dev/null", "-o", f"Dir::Etc::SourceParts={root / 'etc'}",
            "-o", f"Dir::State::Lists={root / 'lists'}", "-o", f"Dir::Cache={root / 'cache'}",
            "-o", "Debug::NoLocking=1"]


def fetch_runtime(dest: Path, log: Path, say: Say) -> list[str]:
    """Download Debian 13's C runtime with a private apt configuration and unpack it into ``dest``; returns the
    .deb files' names."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise WheelInstallError(f"the system glibc is older than {'.'.join(map(str, MIN_GLIBC))} and there is no "
                                    f"{tool} to fetch a newer runtime with")
    say(f"  fetching {', '.join(RUNTIME_PACKAGES)} of Debian {RUNTIME_SUITE} (private apt configuration)")
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-apt-") as tmp:
        root = Path(tmp)
        for sub in ("etc", "lists/partial", "cache/archives/partial", "debs"):
            (root / sub).mkdir(parents=True)
        (root / "etc" / f"{RUNTIME_SUITE}.sources").write_text(
            f"Types: deb\nURIs: {RUNTIME_MIRROR}\nSuites: {RUNTIME_SUITE}\nComponents: main\n"
            f"Signed-By: {RUNTIME_KEYRING}\n")
        opts = apt_options(root)
        _run(["apt-get", *opts, "update"], log, what=f"apt-get update ({RUNTIME_SUITE})")
        # apt downloads as the _apt user when it can and warns that it cannot here (a root-owned folder): harmless.
        _run(["apt-get", *opts, "download", *RUNTIME_PACKAGES], log, cwd=root / "debs",
             what=f"apt-get download {' '.join(RUNTIME_PACKAGES)}")
        debs = sorted((root / "debs").glob("*.deb"))
        if len(debs) < len(RUNTIME_PACKAGES):
            raise WheelInstallError(f"apt-get downloaded {len(debs)} of {len(RUNTIME_PACKAGES)} packages; see {log}")
        staging = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for deb in debs:
            _run(["dpkg-deb", "-x", str(deb), str(staging)], log, what=f"dpkg-deb -x {deb.name}")
        if not (staging / RUNTIME_LIBDIR / "ld-linux-x86-64.so.2").is_file():
            raise WheelInstallError(f"the unpacked {RUNTIME_SUITE} libc6 has no loader at {RUNTIME_LIBDIR}")
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
        return [d.name for d in debs]


def fetch_wheel(peer: Peer, log: Path, say: Say) -> None:
    """``pip install --target`` of the wheel alone (its dependencies are the kit's own: cffi, numpy)."""
    import sys

    say(f"  {peer.version}: fetching {peer.requirement} (wheel)")
    staging = peer.prefix / "site.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", "--only-binary",
          ":all:", "--no-compile", "--target", str(staging), peer.requirement], log,
         what=f"pip install {peer.requirement}")
    if not (staging / peer.wheel_dir.name / "libggml-rpc.so.0").is_file():
        raise WheelInstallError(f"{peer.requirement} has no {peer.wheel_dir.name}/libggml-rpc.so.0; see {log}")
    shutil.rmtree(peer.prefix / "site", ignore_errors=True)
    staging.rename(peer.prefix / "site")


def already_installed(peer: Peer, what: str, say: Callable[[str], None]) -> dict[str, object]:
    """An installed peer's record, its vocabulary brought up to date (upstream's, once a 6/7 build is there to copy
    it from), said in one line."""
    info = peer.info()
    vocab = install_vocab(peer)
    if vocab != info.get("vocab"):
        info["vocab"] = vocab
        peer.record.write_text(json.dumps(info, indent=2) + "\n")
    say(f"{peer.label}: already installed in {peer.prefix} ({what}, installed in "
        f"{info.get('install_seconds', '?')} s); vocabulary: {vocab}")
    return info


def install_vocab(peer: Peer) -> str:
    """Give the wheel peer a vocabulary for the kit's tiny models; returns where it came from.

    The wheel ships none. upstream's ``ggml-vocab-llama-spm.gguf`` is copied from an installed 6/7 build when there is
    one (the same file the sdists carry, so the 8.0.0 models are those of the other rows); otherwise a synthetic
    SentencePiece vocabulary of the same size is written with the ``gguf`` package. A later install upgrades a
    synthetic one when a build has appeared since.
    """
    upstream = peer.src_dir / "models" / "ggml-vocab-llama-spm.gguf"
    if upstream.is_file():
        return _vocab_source(peer) or "upstream's ggml-vocab-llama-spm.gguf"
    for other in PEERS.values():
        if other.kind == "sdist" and other.vocab.is_file():
            upstream.parent.mkdir(parents=True, exist_ok=True)
            tmp = upstream.with_name(upstream.name + ".tmp")
            shutil.copyfile(other.vocab, tmp)
            tmp.rename(upstream)
            (peer.src_dir / "models" / SYNTHETIC_VOCAB).unlink(missing_ok=True)
            return f"upstream's ggml-vocab-llama-spm.gguf, copied from {other.version} ({other.requirement})"
    synthetic = peer.src_dir / "models" / SYNTHETIC_VOCAB
    if not synthetic.is_file():
        synthetic.parent.mkdir(parents=True, exist_ok=True)
        write_test_vocab(synthetic.with_name(synthetic.name + ".tmp"), SYNTHETIC_TOKENS).rename(synthetic)
    return f"synthetic ({SYNTHETIC_TOKENS} tokens, written with gguf: no 6/7 build to copy upstream's from)"


def _vocab_source(peer: Peer) -> str | None:
    value = peer.info().get("vocab")
    return value if isinstance(value, str) and value.startswith("upstream") else None


def install_wheel_peer(peer: Peer, *, say: Say = print, force: bool = False) -> dict[str, object]:
    """Install ``peer`` (a wheel peer) unless it is installed already; returns its record (``peer.json``)."""
    if peer.installed() and not force and (peer.loader is not None or not needs_private_runtime()):
        return already_installed(peer, str(peer.info().get("package")), say)
    peer.prefix.mkdir(parents=True, exist_ok=True)
    log = peer.prefix / "install.log"
    log.write_bytes(b"")
    started = time.monotonic()
    if force or not peer.rpc_server.is_file():
        fetch_wheel(peer, log, say)
    debs: list[str] = []
    glibc = glibc_version()
    if needs_private_runtime(glibc):
        if force or peer.loader is None:
            debs = fetch_runtime(peer.runtime_dir, log, say)
        else:
            debs = list(peer.info().get("runtime_packages") or [])  # type: ignore[arg-type]
    else:
        shutil.rmtree(peer.runtime_dir, ignore_errors=True)  # the system's C library suffices: run directly
    vocab = install_vocab(peer)
    try:
        hello = ".".join(map(str, server_hello(peer)))
    except HelloError as exc:
        raise WheelInstallError(str(exc)) from None
    if hello != peer.version:
        raise WheelInstallError(f"the {peer.requirement} server answers HELLO {hello}, expected {peer.version}")
    seconds = round(time.monotonic() - started)
    record: dict[str, object] = {
        "version": peer.version, "package": peer.requirement, "kind": "wheel", "hello": hello,
        "llama_cpp_commit": COMMITS.get(peer.version), "install_seconds": seconds, "build_seconds": None,
        "runs": {"module": WHEEL_ENTRY, "python": python_program(),
                 "loader": str(peer.loader) if peer.loader else None,
                 "library_path": [str(peer.runtime_dir / RUNTIME_LIBDIR), str(peer.wheel_dir), libpython_dir()]
                 if peer.loader else [str(peer.wheel_dir)]},
        "system_glibc": ".".join(map(str, glibc)) if glibc else None,
        "runtime_packages": debs, "vocab": vocab,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    peer.record.write_text(json.dumps(record, indent=2) + "\n")
    how = f"through Debian {RUNTIME_SUITE}'s loader" if peer.loader else "on the system's C library"
    say(f"{peer.version}: installed in {peer.prefix} in {seconds} s ({peer.requirement}, runs {how}); its server "
        f"answers HELLO {hello}; vocabulary: {vocab}")
    return record
