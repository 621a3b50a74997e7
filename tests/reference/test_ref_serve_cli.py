"""``ggml-rpc serve`` from the command line, and the server's log lines."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.cli.serve import parse_size
from ggml_rpc.reference import running_server
from ggml_rpc.reference.server import _is_loopback
from ggml_rpc.spec import Command
from refhelpers import TIMEOUT, assert_closes, connect, tensor_in

# `ggml-rpc serve` in a fresh interpreter, through the package's entry function (as the console script runs it).
SERVE_CMD = [sys.executable, "-c", "import sys; from ggml_rpc.conformance.cli import main; sys.exit(main())", "serve"]


def test_serve_runs_and_answers() -> None:
    proc = subprocess.Popen(
        [*SERVE_CMD, "--port", "0", "--proto", "6", "--devices", "2",
         "--mem", "64M", "--alignment", "128", "--max-size", "1G"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"protocol 6\.0\.0 listening on 127\.0\.0\.1:(\d+)", line)
        assert m, line

        class Addr:
            host = "127.0.0.1"
            port = int(m.group(1))

        with connect(Addr) as c:
            assert c.server_version == (6, 0, 0)
            assert c.device_count() == 2
            assert c.get_alignment(1) == 128
            assert c.get_max_size(0) == 1 << 30
            assert c.get_device_memory(1) == (64 << 20, 64 << 20)
    finally:
        proc.terminate()
        proc.wait(timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--mem", "4X"], "not a size"), (["--proto", "9"], "unknown protocol version"),
     (["--devices", "0"], "--devices"), (["--alignment", "0"], "--alignment"), (["--port", "70000"], "--port"),
     (["--cache-max-bytes", "lots"], "not a size")],
)
def test_serve_usage_errors(args, message, capsys) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("512M") == 512 << 20
    assert parse_size("4G") == 4 << 30
    assert parse_size("1TiB") == 1 << 40
    with pytest.raises(ValueError):
        parse_size("-1")


def test_loopback_detection() -> None:
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("192.0.2.1")


def test_one_log_line_per_connection_naming_the_close_rule(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ggml_rpc.reference")
    with running_server("7") as srv:
        with connect(srv) as c:
            t, _h, base = tensor_in(c, 64)
            assert_closes(c, Command.GET_TENSOR, {"tensor": {**t, "data": base + 32}, "offset": 0, "size": 4})
        with connect(srv) as c:
            assert c.device_count() == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "ggml_rpc.reference"]
    conn_lines = [ln for ln in lines if ln.startswith("conn ")]
    assert len([ln for ln in conn_lines if ln.endswith(": open")]) == 2
    closes = [ln for ln in conn_lines if "command(s)" in ln]
    assert len(closes) == 2 and len(conn_lines) == 4  # not verbose: nothing per command
    assert "GET_TENSOR" in closes[0] and "outside its buffer" in closes[0] and "upstream: process abort" in closes[0]
    assert "client closed the connection" in closes[1]


def test_verbose_logs_one_line_per_command(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ggml_rpc.reference")
    with running_server("6", verbose=True) as srv, connect(srv) as c:
        c.device_count()
        c.get_alignment(0)
    lines = [r.getMessage() for r in caplog.records if r.name == "ggml_rpc.reference"]
    assert any(ln.endswith("DEVICE_COUNT size=0") for ln in lines)
    assert any(ln.endswith("GET_ALIGNMENT size=4") for ln in lines)


def test_ipv6_loopback() -> None:
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        ctx = running_server("7", host="::1")
        srv = ctx.__enter__()
    except OSError as exc:
        pytest.skip(f"cannot bind ::1 ({exc})")
    try:
        with connect(srv) as c:
            assert c.device_count() == 1
    finally:
        ctx.__exit__(None, None, None)


def test_port_in_use_is_a_usage_error(capsys) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in err and "Traceback" not in err


@pytest.mark.parametrize("preload", [True, False])
def test_serve_makes_the_kernels_ready_before_listening_unless_told_not_to(preload: bool) -> None:
    proc = subprocess.Popen([*SERVE_CMD, "--port", "0", *([] if preload else ["--no-preload"])],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline()]
        # Scripts read the first line: the listening line, or on a machine's first run the compile notice before it.
        if "compiling the executor's kernels" in lines[0]:
            lines.append(proc.stderr.readline())
        assert "listening on 127.0.0.1:" in lines[-1]
        while "reference server for protocol" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1], lines
        said = [ln for ln in lines if re.search(r"\d+ compiled kernels ready .* in [\d.]+ s", ln)]
        assert len(said) == (1 if preload else 0), lines
    finally:
        proc.terminate()
        proc.wait(timeout=TIMEOUT)
