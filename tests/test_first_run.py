"""First run = every run: the README's first command, ``ggml-rpc check``, on a machine whose numba cache is empty.

Its embedded reference server used to compile its kernels on the first graph that needed them, inside a check's
timeout, so the very first run said "NOT conformant" (COMPUTE-014 timed out) and every later one "conformant".  The
kernels are now compiled before any server listens (:mod:`ggml_rpc.reference.executor.warmup`).  Here the command
runs as a user runs it, with a fresh, empty numba cache: ``NUMBA_CACHE_DIR`` names a new directory, which numba
consults before any cache beside the installed sources, so nothing compiled earlier can be found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.harness import EmbeddedTarget, Runner, select
from ggml_rpc.conformance.sessions.replay import load_captures, replay
from ggml_rpc.reference import running_server
from ggml_rpc.reference.executor import kernel_cache, warmup
from ggml_rpc.spec import V7
from upstream_captures import UPSTREAM_FIXTURES


def _ggml_rpc() -> list[str]:
    """The installed command (as the README runs it), else the module it runs."""
    beside = Path(sys.executable).with_name("ggml-rpc")
    found = str(beside) if beside.exists() else shutil.which("ggml-rpc")
    return [found] if found else [sys.executable, "-m", "ggml_rpc.conformance.cli"]


def test_the_readmes_first_command_is_conformant_with_an_empty_compile_cache(tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    env.pop(warmup.READY, None)  # nothing this test process compiled holds for that cache
    done = subprocess.run([*_ggml_rpc(), "check"], env=env, capture_output=True, text=True, timeout=1800)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    # The run really started cold: it said it compiled, and the empty cache now holds every kernel it compiled.
    assert "compiling the reference executor's kernels" in done.stderr, done.stderr
    compiled = list(cache.rglob("*.nbi"))
    assert len(compiled) >= len(warmup.kernels()), sorted(p.name for p in compiled)
    failures = [line for line in done.stdout.splitlines() if " FAIL " in line or " DIED " in line]
    assert done.returncode == 0, "\n".join([last, *failures, done.stderr[-2000:]])
    assert "→ conformant" in last and "NOT" not in last, last


def test_every_compiled_kernel_is_exercised_by_the_warm_up() -> None:
    """A kernel the drills never call would be compiled by the first graph that needs it, inside a client's wait."""
    warmup.compile_kernels()
    cold = [name for name, n in warmup.signatures().items() if n == 0]
    assert not cold, f"kernels the warm-up does not compile: {cold}"


@pytest.fixture(scope="module")
def warm() -> dict[str, int]:
    warmup.compile_kernels()
    return warmup.signatures()


def _new_since(before: dict[str, int]) -> dict[str, list[str]]:
    now = warmup.kernels()
    return {name: [str(s) for s in k.signatures[before.get(name, 0):]] for name, k in now.items()
            if len(k.signatures) != before.get(name, 0)}


def test_the_catalogue_compiles_nothing_after_the_warm_up(warm: dict[str, int]) -> None:
    """Every graph a check sends (and computes itself as the reference) runs on kernels the warm-up made ready."""
    with Runner(EmbeddedTarget(V7), expect=V7, timeout=60.0, probe_timeout=10.0) as runner:
        runner.run(select(CATALOGUE, "COMPUTE-*,COMM-*,FRAME-03*,FRAME-04*,FRAME-05*,FRAME-06*"), lambda *a: None)
    assert not _new_since(warm)


@pytest.mark.parametrize("name", ["v8-upstream-tiny-q8_0-cold.pcap", "v8-upstream-tiny-f32-big-cold.pcap",
                                  "v6-upstream-tiny-q8_0-cold.pcap"])
def test_genuine_sessions_compile_nothing_after_the_warm_up(warm: dict[str, int], tmp_path: Path, name: str) -> None:
    """llama.cpp's own graphs (views of the KV cache, permuted queries, every product of a tiny model) replayed
    against the reference: no kernel is compiled while the client waits."""
    captures = load_captures([str(UPSTREAM_FIXTURES / name)], None)
    protocol = captures[0].connections[0].protocol or V7
    with running_server(protocol, cache_dir=str(tmp_path)) as srv:
        report = replay([str(UPSTREAM_FIXTURES / name)], srv.host, srv.port)
    assert not report.mismatches, [m.line() for m in report.mismatches]
    assert not _new_since(warm)


_CHILD = """
import sys
from ggml_rpc.reference import running_server
from ggml_rpc.reference.executor import kernel_cache, warmup
with running_server("7") as srv:
    pass
print("numba" in sys.modules, len(warmup._drilled))
"""


@pytest.mark.parametrize("told", [True, False], ids=["told-by-its-parent", "reads-the-record"])
def test_a_server_of_its_own_finds_the_cache_complete_without_warming_up_again(warm: dict[str, int],
                                                                              told: bool) -> None:
    """A warmed-up process's servers (spawned, restarted after every crash by the fuzzer) start without running
    the drills again: told by the environment they inherit (numba not even imported), or from the record the
    warm-up left beside numba's index."""
    env = dict(os.environ)
    assert env.get(warmup.READY, "").startswith(kernel_cache.sources_digest(Path(warmup.__file__).parent))
    if not told:
        del env[warmup.READY]
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    numba_loaded, drills = done.stdout.split()
    assert drills == "0", done.stderr
    assert numba_loaded == ("False" if told else "True")
