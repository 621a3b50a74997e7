"""``ggml-rpc decode`` on the real upstream captures: text, JSON lines, forced versions and user mistakes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from upstream_captures import captures

GEN_REQUESTS = 196  # sum of the per-command totals in real-captures/README.md


@pytest.fixture(scope="module")
def gen_cold(real_captures):
    return str(real_captures / "v7-v7-gen-cold.pcap")


def test_text_output(capsys, gen_cold):
    assert main(["decode", gen_cold]) == 0
    out = capsys.readouterr().out.splitlines()
    headers = [line for line in out if line.startswith("# connection")]
    assert len(headers) == 11 and all(line.endswith("protocol 7.0.0") for line in headers)
    requests = [line for line in out if " > " in line]
    replies = [line for line in out if " < " in line]
    assert len(requests) == GEN_REQUESTS
    assert sum("< HELLO version=7.0.0" in line for line in replies) == 11
    assert any(line.endswith("> SET_TENSOR output.weight F32[256,32000,1,1] offset=0 bytes=32768000 cache_flag=1")
               for line in requests)
    assert any("> SET_TENSOR_HASH output.weight F32[256,32000,1,1] offset=0 hash=446e2d6404939d1e" in line
               for line in requests)
    assert any(line.endswith("< SET_TENSOR_HASH miss") for line in replies)
    # no reply line is printed for a no-reply command
    assert not any(f"< {cmd}" in line for line in replies for cmd in ("SET_TENSOR ", "GRAPH_COMPUTE", "FREE_BUFFER"))


def test_json_output(capsys, gen_cold):
    assert main(["decode", "--json", "-", gen_cold]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    opens = [r for r in records if r.get("event") == "open"]
    assert len(opens) == 11 and {r["version"] for r in opens} == {"7.0.0"}
    reqs = [r for r in records if r.get("dir") == "request"]
    counts = Counter(r["command"] for r in reqs)
    assert sum(counts.values()) == GEN_REQUESTS
    assert counts["SET_TENSOR"] == 122 and counts["GRAPH_RECOMPUTE"] == 14
    flagged = [r for r in reqs if r["command"] == "SET_TENSOR" and r["cache_flag"]]
    assert len(flagged) == 1
    assert flagged[0]["tensor"] == "output.weight" and flagged[0]["bytes"] == 32_768_000
    hello = next(r for r in records if r.get("dir") == "reply" and r["command"] == "HELLO")
    assert (hello["major"], hello["minor"], hello["patch"]) == (7, 0, 0)
    assert not any(r.get("event") == "error" for r in records)


def test_forcing_v6_on_the_v7_capture_fails_at_set_tensor(capsys, gen_cold):
    assert main(["decode", "--proto", "6", gen_cold]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ggml-rpc decode: spec violation: connection 10")
    assert "SET_TENSOR" in err[0] and "at byte" in err[0]
    assert "Traceback" not in captured.err
    # everything before the offending SET_TENSOR was printed
    assert "> HELLO" in captured.out


def test_forcing_v6_json_error_record(capsys, gen_cold):
    assert main(["decode", "--proto", "6", "--json", "-", gen_cold]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    errors = [r for r in records if r.get("event") == "error"]
    assert len(errors) == 1
    assert errors[0]["command"] == "SET_TENSOR" and errors[0]["connection"] == 10
    assert isinstance(errors[0]["offset"], int) and errors[0]["field"]


def _console_script() -> str:
    """The installed ``ggml-rpc`` entry point of the running interpreter's environment."""
    beside = Path(sys.executable).with_name("ggml-rpc")
    found = str(beside) if beside.exists() else shutil.which("ggml-rpc")
    assert found, "the ggml-rpc console script is not installed"
    return found


def test_missing_file_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [_console_script(), "decode", str(tmp_path / "absent.pcap")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ggml-rpc decode: error: cannot open {tmp_path / 'absent.pcap'}: No such file or directory"
    ]


def test_not_a_capture_and_bad_version(capsys, tmp_path, gen_cold):
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(b"definitely not a capture file")
    assert main(["decode", str(junk)]) == 2
    assert "not a pcap or pcapng file" in capsys.readouterr().err
    assert main(["decode", "--proto", "5", gen_cold]) == 2
    assert "unknown protocol version '5'" in capsys.readouterr().err


@pytest.mark.parametrize(("path", "connections"), captures({"v6-upstream-tiny-q8_0-cold.pcap": 13},
                                                           {"v6-v6-gen-cold.pcap": 11}))
def test_v6_capture_auto_detects(capsys, path, connections):
    assert main(["decode", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("protocol 6.0.0") == connections and "cache_flag" not in out


def test_decode_reads_standard_input_as_pcap_record_writes_it() -> None:
    """``ggml-rpc pcap record -o - | ggml-rpc decode -``: the same listing as of the file."""
    cli = [sys.executable, "-m", "ggml_rpc.conformance.cli"]
    record = subprocess.Popen([*cli, "pcap", "record", "--scenario", "inference", "-o", "-"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        decoded = subprocess.run([*cli, "decode", "-"], stdin=record.stdout, capture_output=True, text=True,
                                 timeout=300)
    finally:
        assert record.stdout is not None
        record.stdout.close()
        record.wait(timeout=300)
    assert record.returncode == 0 and decoded.returncode == 0, decoded.stderr
    lines = decoded.stdout.splitlines()
    assert lines[0].startswith("# connection 0:") and any(" > GRAPH_COMPUTE" in line for line in lines)
    fixture = subprocess.run([*cli, "decode", "fixtures/v7-inference.pcap"], capture_output=True, text=True,
                             timeout=300).stdout.splitlines()
    # The same session (other ports, other handles): the same commands in the same order.
    assert [line.split(" > ")[1].split()[0] for line in lines if " > " in line] == \
        [line.split(" > ")[1].split()[0] for line in fixture if " > " in line]
