"""Captures of any size in bounded memory: decode, lint and replay of a ~1 GB capture each stay under 256 MiB of
peak RSS above the interpreter's baseline (measured, never timed).

The capture (bench/large_capture.py) holds two 256 MiB SET_TENSORs, each after a SET_TENSOR_HASH miss and
flagged for the cache (so lint hashes each payload, piece by piece), and their two 256 MiB GET_TENSOR replies.
Each command runs as the only child of a fresh wrapper process whose RUSAGE_CHILDREN gives its peak RSS;
the baseline is the same command on a tiny capture (the interpreter and every module the command imports).  The
replay's target is a reference server in this process, so its buffers do not count against the replayer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ggml_rpc.bench.large_capture import MiB, measure, write_large_capture
from ggml_rpc.reference import running_server

BOUND_KIB = 256 * 1024

pytestmark = pytest.mark.memory


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory):
    where = tmp_path_factory.mktemp("bounded")
    large, tiny = where / "large.pcap", where / "tiny.pcap"
    write_large_capture(large, tensors=2, size=256 * MiB, hash_first=True)
    write_large_capture(tiny, tensors=2, size=MiB, hash_first=True)
    yield large, tiny
    shutil.rmtree(where, ignore_errors=True)  # a gigabyte: not left for pytest's retention of old tmp dirs


def _cli() -> str:
    cli = shutil.which("ggml-rpc")
    if cli is None:
        pytest.skip("the ggml-rpc command is not installed")
    return cli


@pytest.mark.parametrize("command", ["decode", "lint", "replay"])
def test_peak_rss_is_bounded_whatever_the_capture_size(captures: tuple[Path, Path], command: str) -> None:
    large, tiny = captures
    assert large.stat().st_size > 1 << 30
    with running_server("7", mem=2 << 30, max_size=2 << 30) as srv:
        extra = ["--server", f"{srv.host}:{srv.port}"] if command == "replay" else []
        base = measure([_cli(), command, str(tiny), *extra])
        got = measure([_cli(), command, str(large), *extra])
    assert base["rc"] == 0 and got["rc"] == 0, got["stderr"]
    grew = got["peak_kib"] - base["peak_kib"]
    assert grew < BOUND_KIB, f"{command}: peak RSS {got['peak_kib'] // 1024} MiB, {grew // 1024} MiB over the " \
                             f"{base['peak_kib'] // 1024} MiB baseline"
