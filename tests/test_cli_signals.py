"""SIGINT and SIGTERM, to the process or to its whole process group (as ``timeout`` sends them), stop every
long-running command within 2 s with exit code 130, invent no finding, and leave nothing running behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli.interrupts import EXIT_INTERRUPTED
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.reference import running_server
from ggml_rpc.spec import make_tensor

CLI = [sys.executable, "-m", "ggml_rpc.conformance.cli"]
FIXTURE = str(Path(__file__).resolve().parent.parent / "fixtures" / "v7-inference.pcap")
#: The promise: stopped within 2 s of the signal (the interpreter's own exit included).
STOP_SECONDS = 2.0


class Running:
    """A command started in a session of its own (so its process group is its own), its output collected."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                         for s in (self.proc.stdout, self.proc.stderr)]
        for t in self._readers:
            t.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"never printed {text!r}: {''.join(self.lines)}")
                self._cond.wait(min(left, 0.2))

    def stop(self, signum: int, *, group: bool) -> float:
        """Send the signal, return the seconds the command took to exit."""
        t0 = time.monotonic()
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        seconds = time.monotonic() - t0
        for t in self._readers:
            t.join(5)
        return seconds

    @property
    def output(self) -> str:
        return "".join(self.lines)


def group_members(pgid: int) -> list[int]:
    """Processes still in a process group (a command's spawned children left behind)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    found.append(int(entry))
            except ProcessLookupError:
                pass
    return found


def processes_naming(token: str) -> list[int]:
    """Processes whose command line contains ``token`` (a spawned target in a session of its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if token in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def assert_stopped(run: Running, seconds: float) -> None:
    assert run.proc.returncode == EXIT_INTERRUPTED, run.output
    assert seconds < STOP_SECONDS, f"took {seconds:.1f} s to stop: {run.output}"
    assert "Traceback" not in run.output
    assert "interrupted (SIG" in run.output
    deadline = time.monotonic() + 2
    while group_members(run.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_members(run.proc.pid), "processes of the command's group outlived it"


HOW = [pytest.param(signal.SIGINT, False, id="SIGINT"), pytest.param(signal.SIGTERM, False, id="SIGTERM"),
       pytest.param(signal.SIGINT, True, id="SIGINT-group"), pytest.param(signal.SIGTERM, True, id="SIGTERM-group")]


@pytest.mark.parametrize(("signum", "group"), HOW)
def test_fuzz_stops_at_once_and_saves_no_finding(tmp_path, signum, group):
    # The embedded target is a child process in the fuzzer's group: a group signal kills it too, which must not
    # become "crash: killed by signal SIGTERM".
    out = tmp_path / "findings"
    run = Running(["fuzz", "--seconds", "60", "--out", str(out)])
    run.wait_for("fuzzing ")
    time.sleep(1.5)  # well into the campaign
    seconds = run.stop(signum, group=group)
    assert_stopped(run, seconds)
    assert "FINDING" not in run.output
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize(("signum", "group"), HOW)
def test_serve_exits_130(signum, group):
    run = Running(["serve", "--port", "0"])
    run.wait_for("listening on")
    assert_stopped(run, run.stop(signum, group=group))


@pytest.mark.parametrize(("signum", "group"), [HOW[0], HOW[3]])
def test_check_with_a_spawned_target_exits_130_and_stops_the_target(tmp_path, signum, group):
    token = str(tmp_path / "spawned-cache")  # names the spawned server's process
    run = Running(["check", "--spawn", f"{sys.executable} -m ggml_rpc.conformance.cli serve --port {{port}} "
                   f"--cache-dir {token}"])
    run.wait_for("ggml-rpc check ")
    time.sleep(0.5)
    assert processes_naming(token)
    assert_stopped(run, run.stop(signum, group=group))
    assert not processes_naming(token), "the spawned target outlived check"


@pytest.mark.parametrize(("signum", "group"), [HOW[1], HOW[2]])
def test_replay_waiting_for_a_silent_server_exits_130(signum, group):
    # A server that accepts and never answers: replay waits (its --timeout is 120 s) until the signal.
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        run = Running(["replay", FIXTURE, "--server", f"127.0.0.1:{listener.getsockname()[1]}"])
        deadline = time.monotonic() + 60
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert accepted, run.output
        time.sleep(0.3)
        assert_stopped(run, run.stop(signum, group=group))
        assert "MISMATCH" not in run.output and "DIED" not in run.output
    finally:
        for s in [listener, *accepted]:
            s.close()


@pytest.mark.parametrize(("signum", "group"), [HOW[0], HOW[3]])
def test_bench_exits_130(tmp_path, signum, group):
    # Many samples: the run must still be measuring when the signal comes (a quick run can end within a second).
    run = Running(["bench", "--quick", "--repeat", "500", "--no-upstream", "--json", str(tmp_path / "b.json")])
    run.wait_for("quick run")
    time.sleep(1.0)
    assert run.proc.poll() is None, run.output
    assert_stopped(run, run.stop(signum, group=group))
    assert not (tmp_path / "b.json").exists()


def test_a_build_step_is_stopped_with_the_install(tmp_path):
    # `upstream install` runs pip and cmake for minutes: interrupted, it must not leave them building.
    seconds = str(30000 + os.getpid() % 10000)  # names the build step (a `sleep`) among the processes
    script = ("import sys; from pathlib import Path; from ggml_rpc.conformance.cli import interrupts; "
              "from ggml_rpc.conformance.upstream.install import _run_logged\n"
              "with interrupts.handling():\n"
              "    try:\n"
              "        _run_logged(['sleep', sys.argv[2]], Path(sys.argv[1]), {}, print, 'build')\n"
              "    except KeyboardInterrupt:\n"
              "        sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "log"), seconds], start_new_session=True)
    step = f"sleep\0{seconds}"
    try:
        deadline = time.monotonic() + 30
        while not processes_naming(step) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_naming(step)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
        assert time.monotonic() - t0 < STOP_SECONDS
        assert not processes_naming(step), "the build step outlived the install"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(("signum", "group"), [HOW[1], HOW[2]])
def test_the_proxy_completes_its_pcap_and_exits_130(tmp_path, signum, group):
    pcap = tmp_path / "terminated.pcap"
    data = bytes(range(256)) * 4096  # 1 MiB: more than any write buffer, so a lost tail would show
    with running_server("7") as srv:
        run = Running(["proxy", "--listen", "127.0.0.1:0", "--upstream", f"{srv.host}:{srv.port}",
                       "--output", str(pcap)])
        run.wait_for("ggml-rpc proxy:")
        banner = next(line for line in run.lines if line.startswith("ggml-rpc proxy:"))
        host, port = banner.split()[2].rsplit(":", 1)
        with RpcClient.connect(host, int(port)) as c:
            handle, _ = c.alloc_buffer(0, len(data))
            t = make_tensor(id=1, type=24, ne=(len(data),), buffer=handle, data=c.buffer_get_base(handle))
            c.set_tensor(t, 0, data)
            assert bytes(c.get_tensor(t, 0, len(data))) == data
        assert_stopped(run, run.stop(signum, group=group))
    assert "1 connection(s)" in run.output
    (dc,) = decode_file(pcap)
    assert dc.error is None
    assert bytes(dc.replies[-1].data) == data
