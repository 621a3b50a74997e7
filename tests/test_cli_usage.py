"""User mistakes on every command: one clear line on stderr naming the problem, exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main

FIXTURE = str(Path(__file__).resolve().parent.parent / "fixtures" / "v7-inference.pcap")


def usage_error(capsys, argv: list[str]) -> str:
    """Run the CLI, require exit code 2 and exactly one line on stderr; return that line."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ggml-rpc {argv[0]}: error: ")
    return lines[0]


@pytest.mark.parametrize(("argv", "expected"), [
    (["replay", FIXTURE, "--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: no such directory"),
    (["replay", FIXTURE, "--nmse", "-1"], "--nmse must be a non-negative number"),
    (["replay", FIXTURE, "--nmse", "nan"], "--nmse must be a non-negative number"),
    (["replay", FIXTURE, "--timeout", "0"], "--timeout must be positive"),
    (["replay", FIXTURE, "--server", "127.0.0.1:1"], "cannot connect to 127.0.0.1:1: Connection refused"),
    (["replay", FIXTURE, "--server", "nowhere"], "--server: expected HOST:PORT, got 'nowhere'"),
    (["check", "--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: no such directory"),
    (["check", "--junit", "/"], "--junit /: is a directory"),
])
def test_replay_and_check_options(capsys, argv, expected):
    assert expected in usage_error(capsys, argv)


def test_replay_json_is_written(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["replay", FIXTURE, "--json", str(out)]) == 0
    assert '"ok": true' in out.read_text()
    assert "0 mismatch(es)" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "expected"), [
    (["pcap", "record", "--scenario", "inference", "-o", "{tmp}/x.pcap", "--server", "127.0.0.1:1"],
     "cannot reach 127.0.0.1:1: Connection refused"),
    (["pcap", "record", "--all", FIXTURE], f"--all {FIXTURE}: not a directory"),
    (["pcap", "record", "--scenario", "inference", "-o", "{tmp}/x.pcap", "--mss", "0"], "--mss must be 1..65495"),
    (["pcap", "record", "--scenario", "inference", "-o", "{tmp}/x.pcap", "--mss", "65496"], "--mss must be 1..65495"),
    (["pcap", "record", "--scenario", "inference", "-o", "{tmp}/no/x.pcap"], "-o {tmp}/no/x.pcap: no such directory"),
    (["pcap", "record", "--scenario", "model-load", "-o", "{tmp}/x.pcap", "--hash-weight-bytes", "0"],
     "--hash-weight-bytes must be at least 1"),
    (["proxy", "--upstream", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--mss", "0"], "--mss must be 1..65495"),
    (["proxy", "--upstream", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--pcap", "{tmp}/no/x.pcap"],
     "--output {tmp}/no/x.pcap: no such directory"),
    (["proxy", "--upstream", "127.0.0.1:1", "--listen", "nowhere"], "--listen: expected HOST:PORT, got 'nowhere'"),
    (["proxy", "--upstream", "127.0.0.1:0"], "--upstream: expected HOST:PORT, got '127.0.0.1:0'"),
])
def test_pcap_record_and_proxy_options(tmp_path, capsys, argv, expected):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert expected.replace("{tmp}", str(tmp_path)) in usage_error(capsys, argv)
    assert not (tmp_path / "x.pcap").exists()


def test_pcap_record_against_a_server_that_closes_is_one_line(tmp_path, capsys):
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def close_everything() -> None:
        with listener:
            for _ in range(8):  # the scenario gives up after the first closed connection
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                conn.close()

    threading.Thread(target=close_everything, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        assert main(["pcap", "record", "--scenario", "inference", "-o", str(tmp_path / "x.pcap"),
                     "--server", f"127.0.0.1:{port}"]) == 1
    finally:
        listener.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ggml-rpc pcap: the scenario failed against 127.0.0.1:{port}: "
                   "server closed the connection after 0 of 8 bytes"]


def test_serve_options(tmp_path, capsys):
    import socket

    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"")
    assert usage_error(capsys, ["serve", "--alignment", "48"]).endswith("--alignment must be a power of two")
    assert usage_error(capsys, ["serve", "--port", "0", "--cache-dir", str(a_file)]).endswith(
        f"--cache-dir {a_file}: not a directory")
    assert usage_error(capsys, ["serve", "--port", "0", "--cache-dir", str(a_file / "sub")]).endswith(
        f"--cache-dir {a_file / 'sub'}: Not a directory")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert usage_error(capsys, ["serve", "--port", str(port)]).endswith(
            f"cannot listen on 127.0.0.1:{port}: Address already in use")


@pytest.mark.parametrize(("argv", "expected"), [
    (["check", "--bogus"], "ggml-rpc check: error: unrecognized arguments: --bogus (see ggml-rpc check --help)"),
    (["decode", FIXTURE, "--port", "65536"], "ggml-rpc decode: error: argument --port: expected a TCP port 1..65535"),
    (["lint", FIXTURE, "--port", "-1"], "ggml-rpc lint: error: argument --port: expected a TCP port 1..65535"),
    (["pcap"], "ggml-rpc pcap: error: the following arguments are required: ACTION (see ggml-rpc pcap --help)"),
    (["no-such-command"], "ggml-rpc: error: argument COMMAND: invalid choice: 'no-such-command'"),
])
def test_argument_errors_are_one_line(capsys, argv, expected):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(expected)


def test_decode_says_when_no_connection_matches(capsys):
    assert main(["decode", FIXTURE, "--port", "9"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"ggml-rpc decode: no TCP connection with port 9 in {FIXTURE}\n"


@pytest.mark.parametrize("command", ["decode", "lint", "replay"])
def test_a_file_that_is_no_capture_is_named(tmp_path, capsys, command):
    junk = tmp_path / "notes.txt"
    junk.write_text("not a capture\n")
    argv = [command, FIXTURE, str(junk)] if command != "decode" else [command, str(junk)]
    assert usage_error(capsys, argv).endswith(f"{junk}: not a pcap or pcapng file")


def test_replay_against_a_server_that_answers_garbage_is_refused_before_the_captures(capsys):
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_http() -> None:
        with listener:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        assert main(["replay", FIXTURE, "--server", f"127.0.0.1:{port}", "--timeout", "5"]) == 2
    finally:
        listener.close()
    out, err = capsys.readouterr()
    # The replay's own HELLO finds no ggml RPC server there: one line, nothing of the captures sent.
    assert out == "" and err.count("\n") == 1
    assert "does not answer HELLO as a ggml RPC server" in err and "reply size" in err


def test_serve_prints_an_ipv6_address_that_check_reads_back():
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "ggml_rpc.conformance.cli", "serve", "--host", "::1", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        if "cannot listen" in line:
            pytest.skip(f"no IPv6 loopback here: {line.strip()}")
        address = line.split()[-1]
        assert address.startswith("[::1]:")
        assert main(["check", "--server", address, "--checks", "HELLO-001"]) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 130  # every command stopped by a signal exits 130


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"ggml-rpc-kit {metadata.version('ggml-rpc-kit')}\n"


def test_replay_json_on_stdout_is_one_document(capsys):
    import json

    assert main(["replay", FIXTURE, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ok"] is True
    assert err.rstrip().endswith("0 mismatch(es)")
