"""The kit's fork server: a spawned server's death costs a fork of the server as it first accepted a connection, and
is reported as a process's death is (the child's status, its own log, its own sanitizer report)."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ggml_rpc.conformance.fuzz.channel import TargetConnection
from ggml_rpc.conformance.harness import SpawnedTarget
from ggml_rpc.conformance.harness.forkserver import ForkServer

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and not os.environ.get("CI"),
                                reason="the fork server is compiled with the system's C compiler (none here)")


def command(*extra: str) -> str:
    return shlex.join([sys.executable, str(HERE / "forking_server.py"), "{port}", *extra]).replace("'{port}'",
                                                                                                  "{port}")


@pytest.fixture
def spawned() -> Iterator[list[SpawnedTarget]]:
    started: list[SpawnedTarget] = []
    yield started
    for target in started:
        target.stop()


def start(spawned: list[SpawnedTarget], *extra: str, fork_server: bool = True) -> SpawnedTarget:
    target = SpawnedTarget(command(*extra), fork_server=fork_server)
    spawned.append(target)
    target.start()
    return target


def ask(target: SpawnedTarget, line: str, *, reply: bool = True) -> str:
    with socket.create_connection((target.host, target.port), timeout=5) as conn:
        conn.sendall(line.encode() + b"\n")
        if not reply:
            return ""
        conn.shutdown(socket.SHUT_WR)
        return conn.makefile("rb").read().decode()


def test_a_death_costs_a_fork_and_the_copy_is_as_the_server_first_accepted(spawned):
    target = start(spawned)
    assert target.forking and target.fork_note == ""
    supervisor = target.proc.pid
    first = [int(w) for w in ask(target, "count").split()]
    again = [int(w) for w in ask(target, "count").split()]
    assert again == [first[0] + 1, first[1]]  # one copy serves every connection until it dies
    assert first[1] != supervisor and target.pid == first[1]
    ask(target, "crash")
    # The death is read from the supervisor's report (it comes just after the connection closes).
    assert target.death_info()["status"] == "killed by signal SIGSEGV" and target.process_exited()
    target.restart()
    assert (target.restarts, target.fork_restarts) == (1, 1)
    served, pid = (int(w) for w in ask(target, "count").split())
    # Nothing of the dead copy's connections: the count starts again, in a new process of the same supervisor.
    assert served == 1 and pid not in (first[1], supervisor) and target.proc.pid == supervisor
    assert not target.process_exited()


def test_a_dead_copy_refuses_connections_until_the_restart(spawned):
    target = start(spawned)
    ask(target, "exit 3")
    assert target.death_info()["status"] == "exited with code 3"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((target.host, target.port), timeout=5)
    assert target.process_exited()
    target.restart()
    assert ask(target, "say back").strip() == "ok"


def test_each_death_is_reported_with_its_own_status_and_log(spawned):
    target = start(spawned)
    ask(target, "say first copy")
    ask(target, "crash")
    info = target.death_info()
    assert (info["status"], info["exit_code"]) == ("killed by signal SIGSEGV", -11)
    assert info["log_tail"] == ["first copy", "about to crash"]
    target.restart()
    ask(target, "say second copy")
    ask(target, "exit 3")
    info = target.death_info()
    assert (info["status"], info["exit_code"], info["log_tail"]) == ("exited with code 3", 3, ["second copy"])
    # The server's own lines stay in the target's log; the supervisor's never show.
    assert "forking_server listening" in target.log[0]
    assert not any(ForkServer().token in line or "ggml-rpc-kit-fork-server" in line for line in target.log)


def test_a_fatal_sanitizer_report_belongs_to_the_copy_that_printed_it(spawned):
    target = start(spawned)
    ask(target, "asan")
    info = target.death_info()
    assert info["sanitizer"]["kind"] == "heap-buffer-overflow"
    assert info["status"].startswith("exited with code 1 after AddressSanitizer: heap-buffer-overflow")
    target.restart()
    ask(target, "crash")
    info = target.death_info()
    assert "sanitizer" not in info and info["status"] == "killed by signal SIGSEGV"


def test_a_hung_copy_is_killed_and_replaced(spawned):
    target = start(spawned)
    hung = target.pid
    ask(target, "hang", reply=False)
    assert not target.process_exited()
    target.restart()
    assert target.fork_restarts == 1 and target.pid != hung
    assert ask(target, "count").split()[0] == "1"
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)  # killed and reaped by the supervisor


def test_a_server_with_other_threads_at_accept_runs_as_a_plain_process(spawned):
    target = start(spawned, "--thread")
    assert not target.forking and "2 threads" in target.fork_note
    first = target.proc.pid
    ask(target, "crash")
    assert target.death_info()["status"] == "killed by signal SIGSEGV" and target.process_exited()
    target.restart()
    assert target.proc.pid != first and target.fork_restarts == 0
    assert ask(target, "count").split()[1] == str(target.proc.pid)


def test_a_server_that_cannot_start_with_the_preload_is_started_without_it(spawned):
    target = start(spawned, "--no-preload")
    assert not target.forking and "did not start with it" in target.fork_note
    assert "ASan runtime does not come first" in target.fork_note
    assert ask(target, "say fine").strip() == "ok"


def test_without_the_fork_server_a_restart_is_a_new_process(spawned):
    target = start(spawned, fork_server=False)
    assert not target.forking and target.fork_note == ""
    first = target.proc.pid
    ask(target, "crash")
    target.restart()
    assert target.proc.pid != first and (target.restarts, target.fork_restarts) == (1, 0)


def test_a_server_blocked_reading_its_connection_is_seen_waiting_for_input(spawned):
    target = start(spawned)
    with socket.create_connection((target.host, target.port), timeout=5) as conn:
        conn.sendall(b"count\n")
        conn.recv(100)
        time.sleep(0.2)  # as a read asks only after a quiet spell (IDLE_AFTER)
        # It answered and reads the connection again: nothing more comes from it until the client sends.
        assert target.waiting_for_input() is True
        conn.sendall(b"hang\n")
        time.sleep(0.2)
        assert target.waiting_for_input() is False  # asleep, but not reading: it may still do something


def test_a_read_ends_as_soon_as_the_server_waits_for_input(spawned):
    target = start(spawned)
    conn = TargetConnection(target.host, target.port, timeout=5.0, idle=target.waiting_for_input)
    try:
        conn.send(b"say hello\n")
        started = time.monotonic()
        got = conn.read(100)  # more than the server will ever send
        assert (got.data, got.idle, got.timed_out) == (b"ok\n", True, True)
        assert time.monotonic() - started < 2.0
    finally:
        conn.close()
