"""Death attribution: a server that dies during a check fails that check at the check's own level, as a death (never
a "connection refused"); a restarted server is waited for; a death no check explains is reported as such.

The server is ``restart_race_server.py`` (it aborts like upstream on FRAME-010's first step).  Every wait is
bounded by the target's startup timeout; nothing asserts on timing.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ggml_rpc.conformance.checks import by_id
from ggml_rpc.conformance.checks._support import session
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.harness import (
    Category,
    Check,
    Context,
    ExternalTarget,
    Level,
    Outcome,
    Result,
    Runner,
    SpawnedTarget,
    free_port,
    hexdump,
    wait_for_port,
)
from ggml_rpc.spec import Command, encode_request

SERVER = Path(__file__).resolve().parent / "restart_race_server.py"
KILL_STEP = "GET_TENSOR past the end of its buffer"
#: Raw command 0xEE: the server stops listening for a moment (see restart_race_server.py).
BLINK = bytes([0xEE]) + bytes(8)


def spawn_command(*extra: str) -> str:
    return " ".join(shlex.quote(a) for a in (sys.executable, str(SERVER), "--port", "{port}", *extra))


def custom(id: str, func: Callable[[Context], str | None], level: Level = Level.MUST) -> Check:
    """A check outside the catalogue (DATA category, MUST unless told: a death fails it at that level)."""
    return Check(id=id, title=f"test check {id}", category=Category.DATA, level=level, majors=(7,),
                 section=Command.GET_TENSOR, func=func)


def kill(ctx: Context) -> RpcClient:
    """First step: a GET_TENSOR past the end of a buffer, which aborts the server; returns its connection."""
    buf = session(ctx)
    sent = encode_request(ctx.protocol, Command.GET_TENSOR,
                         {"tensor": buf.tensor(0, 16, data=buf.base + 4096), "offset": 0, "size": 16})
    ctx.note(KILL_STEP, sent=hexdump(sent, 48))
    buf.client.send_raw(sent)
    return buf.client


def dies_reading_the_reply(ctx: Context) -> None:
    kill(ctx).recv_reply_raw()


def dies_then_connects_again(ctx: Context) -> None:
    # Wait until the connection is gone (the process is dead), so the next connect would be refused for sure.
    assert kill(ctx).expect_closed(timeout=ctx.target.startup_wait)
    ctx.connect().device_count()


def blinks_then_connects_again(ctx: Context) -> None:
    client = ctx.connect()
    client.send_raw(BLINK)
    assert client.expect_closed(timeout=ctx.timeout)  # the listener was closed before this connection
    ctx.note("the server stopped listening for a moment")
    ctx.connect().device_count()  # refused while the process is alive: waited for, not failed


@pytest.fixture
def spawned(tmp_path: Path) -> Callable[..., Runner]:
    """A started Runner on a spawned restart_race_server (``--state`` in tmp_path); stopped after the test."""
    runners: list[Runner] = []

    def make(*extra: str) -> Runner:
        target = SpawnedTarget(spawn_command("--state", str(tmp_path / "started"), *extra))
        runner = Runner(target, timeout=5.0, probe_timeout=5.0)
        runners.append(runner)
        runner.start()
        return runner

    yield make
    for r in runners:
        r.stop()


@pytest.fixture
def external() -> Iterator[tuple[subprocess.Popen[bytes], Runner]]:
    """A restart_race_server the test runs itself (an external target for the harness)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    runner = Runner(ExternalTarget("127.0.0.1", port), timeout=5.0, probe_timeout=5.0)
    try:
        assert wait_for_port("127.0.0.1", port, 20.0, lambda: proc.poll() is None)
        runner.start()
        yield proc, runner
    finally:
        runner.stop()
        proc.kill()
        proc.wait(timeout=10)


def run(runner: Runner, *checks: Check | str) -> dict[str, Result]:
    out = {}
    for c in checks:
        check = by_id(c) if isinstance(c, str) else c
        out[check.id] = runner.run_one(check)
    return out


def assert_death_fails_the_check(r: Result, step: str, status: str = "killed by signal SIGABRT") -> None:
    assert r.outcome is Outcome.FAIL and r.failed_level is r.check.level, r
    assert status in r.message and f"during step '{step}" in r.message, r.message
    text = json.dumps(r.as_dict())  # the report's form of the result: no "refused" verdict anywhere
    assert "connection refused" not in text.lower() and "cannot connect" not in r.message
    assert r.server_death is not None and r.server_death["status"] == status
    assert r.server_death["step"].startswith(step) and r.server_death["sent"]
    death = [e for e in r.evidence if e.got == status]
    assert death and death[-1].sent == r.server_death["sent"]


def test_a_death_on_the_first_step_of_a_must_check_is_its_must_failure(spawned: Callable[..., Runner]) -> None:
    runner = spawned()
    results = run(runner, "FRAME-010", custom("T-DIE-1", dies_reading_the_reply), "DATA-001", "HELLO-001")
    assert by_id("FRAME-010").level is Level.MUST
    assert_death_fails_the_check(results["FRAME-010"], "GET_TENSOR of a tensor past the end of its buffer")
    assert_death_fails_the_check(results["T-DIE-1"], KILL_STEP)  # a MUST check outside framing: MUST too
    should = run(runner, custom("T-DIE-S", dies_reading_the_reply, Level.SHOULD))["T-DIE-S"]
    assert_death_fails_the_check(should, KILL_STEP)  # a SHOULD check: a SHOULD failure (still a death)
    # The next checks run against the restarted server and pass.
    assert results["DATA-001"].outcome is Outcome.PASS and results["HELLO-001"].outcome is Outcome.PASS
    assert runner.target.restarts == 3 and runner.summary()["must_failures"] == 2
    assert runner.unexplained_deaths == []
    verdict = runner.verdict()
    assert verdict.deaths == 3 and verdict.exit_code == 1 and "robustness: 3 deaths" in verdict.line()


def test_a_connect_after_the_death_reports_the_death_not_refused(spawned: Callable[..., Runner]) -> None:
    runner = spawned()
    results = run(runner, custom("T-DIE-2", dies_then_connects_again), "DATA-001")
    assert_death_fails_the_check(results["T-DIE-2"], KILL_STEP)
    assert results["DATA-001"].outcome is Outcome.PASS


def test_a_server_slow_to_come_back_is_waited_for(spawned: Callable[..., Runner]) -> None:
    # After the restart the server accepts the harness's port probe, then refuses for a second: the next check
    # must still find a server (no "restart failed", no refused connect).
    runner = spawned("--on-restart", "blink", "--gap", "1.0")
    results = run(runner, "FRAME-010", "DATA-001", "HELLO-001")
    assert_death_fails_the_check(results["FRAME-010"], "GET_TENSOR of a tensor past the end of its buffer")
    assert not [e for e in results["FRAME-010"].evidence if e.step == "restart failed"]
    assert results["DATA-001"].outcome is Outcome.PASS and results["HELLO-001"].outcome is Outcome.PASS


def test_a_live_server_not_accepting_for_a_moment_is_waited_for_inside_a_check(
        spawned: Callable[..., Runner]) -> None:
    runner = spawned("--gap", "1.0")
    r = run(runner, custom("T-BLINK", blinks_then_connects_again))["T-BLINK"]
    assert r.outcome is Outcome.PASS, r
    assert r.server_death is None and runner.target.restarts == 0


def test_a_failed_restart_is_reported_once_and_the_rest_is_not_run(spawned: Callable[..., Runner]) -> None:
    runner = spawned("--on-restart", "exit")
    results = run(runner, "FRAME-010", "DATA-001", "HELLO-001")
    died = results["FRAME-010"]
    assert_death_fails_the_check(died, "GET_TENSOR of a tensor past the end of its buffer")
    failed = [e for e in died.evidence if e.step == "restart failed"]
    assert len(failed) == 1 and "exited with code 3" in (failed[0].got or "")
    for cid in ("DATA-001", "HELLO-001"):
        assert results[cid].outcome is Outcome.NOT_RUN and not results[cid].failed
        assert "after FRAME-010" in results[cid].message and "restart failed" in results[cid].message
    s = runner.summary()
    assert s["must_failures"] == 1 and s["should_failures"] == 0 and s["not run"] == 2


def test_a_death_no_check_explains_is_reported_as_such(spawned: Callable[..., Runner]) -> None:
    runner = spawned()
    assert run(runner, "HELLO-001")["HELLO-001"].outcome is Outcome.PASS
    proc = runner.target.proc
    proc.send_signal(signal.SIGKILL)  # dies between checks, of nothing a check sent
    proc.wait(timeout=10)
    r = run(runner, "DATA-001")["DATA-001"]
    assert r.outcome is Outcome.PASS and not r.failed and r.server_death is None  # not blamed on it
    assert "found dead before this check started (after HELLO-001)" in r.evidence[0].step
    assert r.evidence[0].got == "killed by signal SIGKILL"
    assert [(d["status"], d["after"], d["before"]) for d in runner.unexplained_deaths] == [
        ("killed by signal SIGKILL", "HELLO-001", "DATA-001")]


def test_external_server_death_is_the_checks_failure_at_its_level_and_ends_the_run(
        external: tuple[subprocess.Popen[bytes], Runner]) -> None:
    proc, runner = external
    results = run(runner, "FRAME-010", "DATA-001")
    died = results["FRAME-010"]
    assert died.outcome is Outcome.FAIL and died.failed_level is Level.MUST
    assert died.message.startswith("server stopped answering during step 'GET_TENSOR of a tensor past the end")
    assert died.server_death is not None and died.server_death["sent"]
    assert results["DATA-001"].outcome is Outcome.NOT_RUN
    assert results["DATA-001"].message == "server stopped answering after FRAME-010"
    assert proc.wait(timeout=10) == -signal.SIGABRT


def test_external_server_found_dead_before_a_check_is_not_blamed_on_it(
        external: tuple[subprocess.Popen[bytes], Runner]) -> None:
    proc, runner = external
    assert run(runner, "HELLO-001")["HELLO-001"].outcome is Outcome.PASS
    proc.kill()
    proc.wait(timeout=10)
    results = run(runner, "DATA-001", "HELLO-002")
    for cid in ("DATA-001", "HELLO-002"):
        assert results[cid].outcome is Outcome.NOT_RUN, results[cid]
        assert results[cid].message == "server stopped answering before DATA-001 (after HELLO-001)"
    assert "found dead before this check started" in results["DATA-001"].evidence[0].step
    assert runner.summary()["fail"] == 0 and len(runner.unexplained_deaths) == 1
    assert runner.verdict().exit_code == 1  # a death no check explains is still a death
