"""Debian's 8.0.0 packages as a peer, and the instrumented 8.0.0 from Debian's ggml source.

The first tests need nothing installed and no network: the private apt configuration, the layout and command lines,
the library check, the interop rows the peer adds. Those marked ``upstream`` need ``ggml-rpc upstream install
--proto 8 --from debian`` (and the wheel's 8.0.0 for the rows that pair them): they skip with one line without it,
and fail instead when CI is set.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tarfile
from importlib import resources
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.harness import free_port, wait_for_port
from ggml_rpc.conformance.upstream import debian, ggml_source, matrix, peers
from ggml_rpc.conformance.upstream import install as install_module
from ggml_rpc.conformance.upstream.hello import raw_hello, server_hello
from ggml_rpc.conformance.upstream.runs import Finished, UpstreamServer, kit
from ggml_rpc.conformance.upstream.workspace import Workspace
from ggml_rpc.conformance.upstream.zoo import quantizer_for

# ---- no install needed --------------------------------------------------------------------------------------


def test_private_apt_configuration_names_sid_and_keeps_every_state_private(tmp_path) -> None:
    sources = debian.write_apt_config(tmp_path, "http://mirror.example/debian", keyring="/k.gpg")
    assert sources.read_text() == ("Types: deb deb-src\nURIs: http://mirror.example/debian\nSuites: sid\n"
                                   "Components: main\nSigned-By: /k.gpg\n")
    # An empty dpkg status: the system's installed packages never decide what is downloaded.
    assert (tmp_path / "state" / "status").read_text() == ""
    for sub in ("lists/partial", "cache/archives/partial", "etc/preferences.d"):
        assert (tmp_path / sub).is_dir()
    opts = debian.apt_options(tmp_path)
    assert opts[0::2] == ["-o"] * (len(opts) // 2)
    values = dict(o.split("=", 1) for o in opts[1::2])
    assert values["Dir::Etc::SourceList"] == values["Dir::Etc::Preferences"] == "/dev/null"
    private = ("Dir::Etc::SourceParts", "Dir::Etc::PreferencesParts", "Dir::State", "Dir::State::Lists",
               "Dir::State::status", "Dir::Cache")
    assert all(values[k].startswith(str(tmp_path)) for k in private)
    assert values["Debug::NoLocking"] == "1"
    assert not any(v.startswith(("/etc/apt", "/var/lib/apt", "/var/cache/apt", "/var/lib/dpkg"))
                   for v in values.values())


def test_the_mirror_is_the_machines_own_debian_mirror() -> None:
    deb822 = ("Types: deb\n# http://snapshot.debian.org/archive/debian/2025\nURIs: http://deb.debian.org/debian\n"
              "Suites: bookworm\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\n"
              "Suites: bookworm-security\n")
    assert debian.system_mirror([deb822]) == "http://deb.debian.org/debian"
    security_first = "deb http://security.debian.org/debian-security bookworm-security main\n"
    one_line = "deb [arch=amd64 signed-by=/k.gpg] http://ftp.fr.debian.org/debian/ bookworm main\n"
    assert debian.system_mirror([security_first, one_line]) == "http://ftp.fr.debian.org/debian"
    vendor = "deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n"
    assert debian.system_mirror([vendor, "# deb http://x/debian sid main\n"]) == debian.DEFAULT_MIRROR


def test_exact_versions_are_pinned_and_the_runtime_comes_from_sid() -> None:
    pins = debian.PACKAGES["8.0.0"]
    assert pins["libggml0"] == pins["libggml0-backend-rpc"] == "0.27.0-1"
    assert pins["llama.cpp-tools"] == pins["llama.cpp-tools-extra"] == pins["libllama0"] == "1:0.7.0+dfsg-2"
    assert {"libc6", "libstdc++6", "libgcc-s1", "libgomp1", "libssl3t64"} <= set(debian.RUNTIME_PACKAGES)


def test_libraries_resolved_outside_the_tree_are_named(tmp_path) -> None:
    tree = tmp_path / "root"
    listing = (f"\tlinux-vdso.so.1 (0x00007ffd)\n"
               f"\t/lib64/ld-linux-x86-64.so.2 => {tree}/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 (0x7f)\n"
               f"\tlibggml.so.0 => {tree}/usr/lib/x86_64-linux-gnu/libggml.so.0 (0x7f)\n"
               "\tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x7f)\n"
               "\tlibfoo.so.2 => not found\n"
               f"\tlibbar.so => {tmp_path}/root-other/libbar.so (0x7f)\n")
    assert debian.outside_libraries(listing, tree) == ["libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1",
                                                       "libfoo.so.2 => not found",
                                                       f"libbar.so => {tmp_path}/root-other/libbar.so"]


def test_backends_are_linked_beside_the_loader_inside_the_tree(tmp_path) -> None:
    backends = tmp_path / debian.BACKENDS
    backends.mkdir(parents=True)
    for name in ("libggml-rpc.so", "libggml-cpu-haswell.so", "libggml-cpu-x64.so"):
        (backends / name).write_bytes(name.encode())
    (backends / "README").write_text("not a backend")
    assert debian.link_backends(tmp_path) == ["libggml-cpu-haswell.so", "libggml-cpu-x64.so", "libggml-rpc.so"]
    link = tmp_path / peers.RUNTIME_LIBDIR / "libggml-rpc.so"
    assert link.is_symlink() and not os.readlink(link).startswith("/") and link.read_bytes() == b"libggml-rpc.so"
    assert not (tmp_path / peers.RUNTIME_LIBDIR / "README").exists()
    assert debian.link_backends(tmp_path) == ["libggml-cpu-haswell.so", "libggml-cpu-x64.so", "libggml-rpc.so"]


def test_started_line_names_the_version() -> None:
    log = "load_backend: loaded RPC backend from /x\nStarting RPC server v8.0.0\n  endpoint : 127.0.0.1:1\n"
    assert debian.started_line(log) == "8.0.0" and debian.started_line("no server here") is None


def test_debian_peer_layout_and_command_lines(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    peer = peers.debian_peer("8.0.0")
    assert (peer.kind, peer.label, peer.tag) == ("debian", "8.0.0+debian", "v8-debian")
    assert peer.prefix == tmp_path / "8.0.0-debian" and peer.runtime_dir == peer.prefix / "root"
    assert peer.rpc_server == peer.runtime_dir / "usr/libexec/x86_64-linux-gnu/llama/bin/ggml-rpc-server"
    assert peer.llama_completion == peer.runtime_dir / "usr/bin/llama-completion"
    assert "Debian sid" in peer.requirement and not peer.installed()
    argv = peer.server_argv("{port}", cache=True)
    loader = peer.runtime_dir / peers.RUNTIME_LIBDIR / peers.LOADER_NAME
    # Always through its own loader, searching only the unpacked tree (the programs' RUNPATH folder included).
    assert argv[:2] == [str(loader), "--library-path"]
    assert argv[2].split(os.pathsep) == [str(peer.runtime_dir / "usr/lib/x86_64-linux-gnu"),
                                         str(peer.runtime_dir / "usr/lib/x86_64-linux-gnu/llama")]
    assert argv[3] == str(peer.rpc_server) and argv[argv.index("-H") + 1] == "127.0.0.1" and argv[-1] == "-c"
    assert "LD_LIBRARY_PATH" not in peer.launch_env() and peer.launch_env()["GGML_NO_BACKTRACE"] == "1"
    words = shlex.split(UpstreamServer(peer, cache=True, llama_cache=tmp_path / "lc").spawn_command())
    assert words[0] == "env" and f"LLAMA_CACHE={tmp_path / 'lc'}" in words and "{port}" in words
    # A run through the loader is named by its program, not the loader.
    assert Finished(argv, 1, "", "", 0.0).program == "ggml-rpc-server"
    with pytest.raises(ValueError, match="Debian ships no build"):
        peers.debian_peer("7.0.0")


def _fake_install(peer: peers.Peer) -> None:
    peer.rpc_server.parent.mkdir(parents=True, exist_ok=True)
    peer.rpc_server.write_bytes(b"")
    peer.record.write_text(json.dumps({"version": peer.version, "install_seconds": 1}))


def test_an_installed_debian_peer_adds_its_rows_to_the_matrix(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    ws = Workspace(tmp_path / "ws")
    before = [r.id for r in matrix.rows(["7.0.0", "8.0.0"], ws, ["tiny-f32"])]
    assert not any("debian" in r for r in before)
    assert peers.peers_of(["8.0.0"]) == [peers.PEERS["8.0.0"]]
    _fake_install(peers.debian_peer("8.0.0"))
    assert peers.peers_of(["7.0.0", "8.0.0"]) == [peers.PEERS["7.0.0"], peers.PEERS["8.0.0"],
                                                  peers.debian_peer("8.0.0")]
    ids = [r.id for r in matrix.rows(["7.0.0", "8.0.0"], ws, ["tiny-f32"])]
    assert len(ids) == len(set(ids))
    assert set(before) < set(ids)
    for row in ("CHECK-v8-debian", "GEN-v8-debian-REF-tiny-f32", "GEN-v8-debian-PROXY-tiny-f32",
                "REPLAY-v8-debian-REFERENCE-tiny-f32", "REPLAY-v8-debian-UPSTREAM-tiny-f32",
                "SPLIT-v8-debian-TENSOR-UP-UP", "SPLIT-v8-debian-LAYER-UP-WHEEL", "SPLIT-v8-debian-TENSOR-UP-WHEEL",
                "SPLIT-v8-TENSOR-UP-DEBIAN", "CROSS-v8-debian-v8", "CROSS-v8-v8-debian", "CROSS-v8-debian-v7",
                "CROSS-v7-v8-debian", "CROSS-CHECK-7-v8-debian"):
        assert row in ids, row
    # The wheel's and Debian's client share one major: one CROSS-CHECK per (major, server).
    assert ids.count("CROSS-CHECK-8-v7") == 1
    # Only the 8.0.0 report keys change with Debian's peer: the other peers' rows and files keep their names.
    assert peers.PEERS["8.0.0"].tag == "v8" and peers.PEERS["8.0.0"].label == "8.0.0"


def test_a_reinstall_takes_upstreams_vocabulary_once_a_build_has_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    peer = peers.debian_peer("8.0.0")
    _fake_install(peer)
    seven = peers.PEERS["7.0.0"]
    seven.vocab.parent.mkdir(parents=True)
    seven.vocab.write_bytes(b"GGUF upstream's vocabulary")
    info = debian.install_debian_peer(peer, say=lambda line: None)
    assert info["vocab"].startswith("upstream's ggml-vocab-llama-spm.gguf, copied from 7.0.0")
    assert peer.vocab.read_bytes() == b"GGUF upstream's vocabulary" and json.loads(peer.record.read_text()) == info


def test_debians_zoo_is_quantised_by_debians_own_programs(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    peer = peers.debian_peer("8.0.0")
    _fake_install(peer)
    peer.llama_quantize.parent.mkdir(parents=True, exist_ok=True)
    peer.llama_quantize.write_bytes(b"")
    assert quantizer_for(peer) is peer
    # Run through its loader like every Debian program.
    argv = peer.command(peer.llama_quantize, "--help")
    assert argv[1] == "--library-path" and argv[3:] == [str(peer.llama_quantize), "--help"]
    with pytest.raises(RuntimeError, match="no installed peer has llama-quantize"):
        quantizer_for(peers.PEERS["8.0.0"])  # the wheel's zoo comes from a built peer only


def test_install_options_are_checked_before_anything_runs(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    assert main(["upstream", "install", "--proto", "8", "--from", "debian", "--sanitize", "address"]) == 2
    assert "--sanitize address" in capsys.readouterr().err
    assert main(["upstream", "install", "--proto", "7", "--from", "debian"]) == 2
    err = capsys.readouterr().err
    assert "Debian ships no build of protocol 7.0.0" in err and "Traceback" not in err
    assert main(["upstream", "install", "--proto", "8", "--source", str(tmp_path)]) == 2
    assert "--source goes with --proto 8 --sanitize address" in capsys.readouterr().err
    assert main(["upstream", "install", "--proto", "8", "--sanitize", "address", "--source",
                 str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_install_from_debian_dispatches_to_the_debian_installer(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(debian, "install_debian_peer", lambda peer, **kw: calls.append(peer.label) or {})
    monkeypatch.setattr(install_module, "install", lambda peer, **kw: calls.append("pypi " + peer.label) or {})
    assert main(["upstream", "install", "--proto", "all", "--from", "debian"]) == 0
    assert calls == ["8.0.0+debian"]


def test_list_shows_the_debian_peer(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    assert main(["upstream", "list"]) == 0
    out = capsys.readouterr().out
    assert "8.0.0+debian  not installed (llama.cpp 1:0.7.0+dfsg-2, ggml 0.27.0-1 (Debian sid); ggml-rpc upstream " \
           "install --proto 8 --from debian)" in out
    assert main(["upstream", "list", "--json", "-", "--no-hello"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["label"], r["kind"], r["from"]) for r in rows] == [
        ("6.0.0", "sdist", "pypi"), ("7.0.0", "sdist", "pypi"), ("8.0.0", "wheel", "pypi"),
        ("8.0.0+debian", "debian", "debian")]


# ---- the instrumented 8.0.0 (built from ggml's source: no build here) --------------------------------------


def _ggml_tree(root: Path, proto: tuple[int, int, int], ggml: tuple[int, int, int] = (0, 27, 0)) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "include" / "ggml-rpc.h").write_text("".join(
        f"#define RPC_PROTO_{part}_VERSION    {n}\n" for part, n in zip(("MAJOR", "MINOR", "PATCH"), proto,
                                                                        strict=True)))
    (root / "CMakeLists.txt").write_text("".join(
        f"set(GGML_VERSION_{part} {n})\n" for part, n in zip(("MAJOR", "MINOR", "PATCH"), ggml, strict=True)))
    return root


def test_the_instrumented_8_is_ggml_alone_with_the_kits_server(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    peer = peers.sanitized_peer("8.0.0")
    assert (peer.kind, peer.label) == ("ggml", "8.0.0+asan-ubsan") and peer.prefix == tmp_path / "8.0.0-asan-ubsan"
    assert peer.rpc_server == peer.prefix / "bin" / peers.KIT_SERVER
    assert peer.server_argv(5, cache=True) == [str(peer.rpc_server), "-H", "127.0.0.1", "-p", "5", "-t", "1", "-c"]
    assert "allocator_may_return_null=1" in peer.launch_env()["ASAN_OPTIONS"]
    options = ggml_source.cmake_options("address")
    for option in ("-DGGML_RPC=ON", "-DGGML_BACKEND_DL=OFF", "-DGGML_SANITIZE_ADDRESS=ON",
                   "-DGGML_SANITIZE_UNDEFINED=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DGGML_NATIVE=OFF"):
        assert option in options
    assert ggml_source.SOURCES["8.0.0"] == ("ggml", "0.27.0-1")


def test_source_versions_and_unpacking(tmp_path) -> None:
    tree = _ggml_tree(tmp_path / "ggml-0.27.0", (8, 0, 0))
    assert ggml_source.source_versions(tree) == ("0.27.0", "8.0.0")
    tarball = tmp_path / "ggml_0.27.0.orig.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tree, arcname="ggml-0.27.0")
    log = tmp_path / "log"
    assert ggml_source.unpack(tarball, tmp_path / "out", log) == "the tarball ggml_0.27.0.orig.tar.gz"
    assert ggml_source.source_versions(tmp_path / "out") == ("0.27.0", "8.0.0")
    with pytest.raises(ggml_source.SourceBuildError, match="not a ggml source tree"):
        ggml_source.source_versions(tmp_path)


def test_a_source_of_another_protocol_is_refused_before_building(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path / "cache"))
    monkeypatch.setattr(ggml_source, "missing_tools", list)
    monkeypatch.setattr(install_module, "missing_tools", list)
    monkeypatch.setattr(ggml_source, "build", lambda *a, **k: pytest.fail("built a source of another protocol"))
    tree = _ggml_tree(tmp_path / "ggml", (5, 1, 0), (0, 21, 0))
    assert main(["upstream", "install", "--proto", "8", "--sanitize", "address", "--source", str(tree)]) == 1
    err = capsys.readouterr().err
    assert "is ggml 0.21.0, protocol 5.1.0: not 8.0.0" in err and "Traceback" not in err
    assert not peers.sanitized_peer("8.0.0").installed()


# ---- Debian's genuine 8.0.0 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def debian8():
    peer = peers.debian_peer("8.0.0")
    if not peer.installed():
        message = "Debian's 8.0.0 not installed: run `ggml-rpc upstream install --proto 8 --from debian`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return peer


@pytest.mark.upstream
def test_record_names_the_exact_packages_and_a_private_tree(debian8) -> None:
    info = debian8.info()
    assert info["kind"] == "debian" and info["hello"] == "8.0.0" and info["started"] == "Starting RPC server v8.0.0"
    for name, version in debian.PACKAGES["8.0.0"].items():
        assert f"{name}={version}" in info["packages"]
    assert any(p.startswith("libc6=2.4") for p in info["packages"])
    assert info["runs"]["loader"].startswith(str(debian8.prefix))
    assert "libggml-rpc.so" in info["runs"]["backends_linked"]
    debian.check_libraries(debian8)  # every program and backend resolves inside the tree


@pytest.mark.upstream
def test_hello_and_start_up_line_announce_8_0_0(debian8, tmp_path) -> None:
    log = tmp_path / "server.log"
    assert server_hello(debian8, log=log) == (8, 0, 0)
    text = log.read_text()
    assert "Starting RPC server v8.0.0" in text
    # The backends came from the private tree (through the links beside its loader), not from a system path.
    loaded = [ln for ln in text.splitlines() if ln.startswith("load_backend: loaded")]
    assert any("RPC backend" in ln for ln in loaded) and any("CPU backend" in ln for ln in loaded)
    assert all(str(debian8.runtime_dir) in ln for ln in loaded)


@pytest.mark.upstream
def test_list_shows_the_installed_debian_peer_with_its_hello(debian8) -> None:
    done = kit("upstream", "list", "--json", "-", timeout=120)
    assert done.ok, done.why()
    row = next(r for r in json.loads(done.stdout) if r["label"] == "8.0.0+debian")
    assert row["installed"] and row["hello"] == "8.0.0" and row["from"] == "debian"
    assert row["rpc_server"] == str(debian8.rpc_server)


@pytest.mark.upstream
def test_a_client_that_leaves_before_its_reply_kills_debians_server_with_sigpipe(debian8, tmp_path) -> None:
    """Debian's server does not ignore SIGPIPE: the check that leaves before its reply reports the death, with the
    signal, on that check (and the run goes on with a restarted server)."""
    server = UpstreamServer(debian8, cache=False, llama_cache=tmp_path / "lc")
    out = tmp_path / "check.json"
    done = kit("check", "--spawn", server.spawn_command(), "--checks", "FRAME-039,HELLO-*", "--json", str(out),
               timeout=300)
    assert done.code == 1, done.why()
    results = {r["id"]: r for r in json.loads(out.read_text())["results"]}
    death = results["FRAME-039"]["server_death"]
    assert death["status"] == "killed by signal SIGPIPE"
    assert all(r["outcome"] == "pass" for i, r in results.items() if i.startswith("HELLO-"))


@pytest.mark.upstream
def test_the_kits_server_program_serves_debians_genuine_libraries(debian8, tmp_path) -> None:
    """The kit's own server program (the instrumented build's) on Debian's genuine 8.0.0 ggml: it finds the RPC
    backend's server entry point through the registry and answers HELLO 8.0.0."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = Path(str(resources.files("ggml_rpc.conformance.upstream").joinpath("rpc_server_main.c")))
    tree = debian8.runtime_dir
    out = tmp_path / peers.KIT_SERVER
    # Linked against sid's libraries, whose symbol versions the system's linker cannot check: resolved at run time
    # by sid's loader.
    subprocess.run([cc, "-O1", "-Wall", "-Werror", "-I", str(tree / "usr/include"), "-o", str(out), str(source),
                    "-L", str(tree / "usr/lib/x86_64-linux-gnu"), "-l:libggml.so.0", "-l:libggml-base.so.0",
                    "-Wl,--allow-shlib-undefined"], check=True, timeout=120)
    assert subprocess.run(debian8.command(out, "-H", "0.0.0.0", "-p", "1"), capture_output=True, text=True,
                          timeout=60).returncode == 2
    port = free_port()
    proc = subprocess.Popen(debian8.command(out, "-H", "127.0.0.1", "-p", str(port)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port("127.0.0.1", port, 20.0, lambda: proc.poll() is None)
        assert raw_hello("127.0.0.1", port) == (8, 0, 0)
    finally:
        proc.kill()
        proc.wait()
