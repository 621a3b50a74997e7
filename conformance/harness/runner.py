"""The runner that drives a live server through the selected checks.

The :class:`Runner` learns the server's version from HELLO before anything version-dependent is sent, runs each
selected check on fresh connections, and after every check makes sure the server still accepts a connection.  A
server that dies during a check fails that check at the check's own level (never a "connection refused"), naming
the exit status, the step and the bytes sent.  A check whose setup the server refuses (:class:`Blocked`) is
"blocked", not failed: its rule never ran.  A spawned server that died
is then restarted and waited for until it answers HELLO, so the next check never races its start; a death found
before a check started is reported as unexplained instead of blamed on it.  An external server that died, or a
failed restart, ends the run: the remaining checks are "not run".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from ggml_rpc.spec import V6, HandshakeError, Protocol, ProtocolError
from ggml_rpc.spec.rules import Level

from ..client import ConnectionClosed, RpcClient
from .context import (
    DEFAULT_SEED,
    Blocked,
    CheckFailed,
    Context,
    Evidence,
    RunFacts,
    ServerGone,
    ServerInfo,
    Skipped,
    Unsupported,
    verdict_for,
)
from .model import Check, Outcome, Result
from .targets import Target, TargetError
from .verdict import Profile, Verdict, judge

ProgressFn = Callable[[Result], None]


class Runner:
    """Runs checks against one target, one at a time, in catalogue order."""

    def __init__(
        self,
        target: Target,
        *,
        expect: Protocol | None = None,
        timeout: float = 5.0,
        probe_timeout: float = 5.0,
        seed: int = DEFAULT_SEED,
    ) -> None:
        self.target = target
        #: Seeds every value a check draws (:meth:`.Context.rng`): one seed, the same bytes sent.
        self.seed = seed
        self.expect = expect
        self.timeout = timeout
        self.probe_timeout = probe_timeout
        self.info = ServerInfo()
        self.shared: dict[str, Any] = {}
        self.dead_after: str | None = None
        #: Why the remaining checks are not run (set with ``dead_after``).
        self.stop_reason: str | None = None
        #: Deaths no check explains (found before a check started): status, log tail, "after" and "before".
        self.unexplained_deaths: list[dict[str, Any]] = []
        self.results: list[Result] = []
        self._last_run: str | None = None
        #: Sanitizer reports of an instrumented spawned server already judged (the next check's are after it).
        self._sanitizer_mark = 0
        self.started_at = 0.0
        self.finished_at = 0.0
        self._started = False
        #: The profile run in place of the whole selection (``check --profile``): the verdict names it.
        self.profile: Profile | None = None

    # -- lifecycle --

    def start(self) -> ServerInfo:
        """Start the target and learn its version from HELLO (raises TargetError when unreachable)."""
        self.started_at = time.time()
        self.target.start()
        self._started = True
        self.handshake()
        return self.info

    def handshake(self) -> None:
        try:
            client = RpcClient.connect(self.target.host, self.target.port, timeout=self.probe_timeout, hello=False)
        except OSError as exc:
            raise TargetError(f"cannot reach {self.target.address}: {exc.strerror or exc}") from None
        with client:
            try:
                fields = client.hello()
            except HandshakeError:
                fields = None  # a version the kit does not cover: server_version is set, the verdict says so
            except (ConnectionClosed, ProtocolError, OSError) as exc:
                raise TargetError(f"{self.target.address} does not answer HELLO as a ggml RPC server: {exc}") from None
            version = client.server_version
            assert version is not None
            self.info.version = version
            self.info.protocol, self.info.verdict = verdict_for(version)
            if fields is not None and self.info.protocol is not None:
                with contextlib.suppress(ConnectionClosed, ProtocolError, OSError):
                    self.info.device_count = client.device_count()

    def stop(self) -> None:
        self.finished_at = time.time()
        if self._started:
            self.target.stop()
            self._started = False

    def __enter__(self) -> Runner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- liveness --

    def server_alive(self) -> bool:
        """Does the server still accept a connection and answer HELLO?"""
        try:
            # Forced table: a version the kit does not cover still counts as an answer.
            with RpcClient.connect(self.target.host, self.target.port, timeout=self.probe_timeout, hello=False,
                                   protocol=self.info.protocol or V6) as c:
                c.hello()
                return True
        except (OSError, ConnectionClosed, ProtocolError):
            return False

    def await_ready(self, timeout: float) -> bool:
        """Poll (bounded by ``timeout``) until the server answers HELLO; False once its process has exited.

        A (re)started server may accept the port probe of :meth:`Target.start` and still refuse or not answer for
        a moment; a crashing one may linger (core dump) before it exits.  Either way the answer is waited for.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.target.process_exited():
                return False
            if self.server_alive():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    # -- running --

    def run(self, checks: Iterable[Check], progress: ProgressFn | None = None) -> list[Result]:
        for check in checks:
            result = self.run_one(check)
            if progress is not None:
                progress(result)
        return self.results

    def _not_applicable(self, check: Check) -> Result | None:
        info = self.info
        if self.dead_after is not None:
            return Result(check, Outcome.NOT_RUN,
                          self.stop_reason or f"server stopped answering after {self.dead_after}")
        if info.version is None:
            return Result(check, Outcome.NOT_RUN, "no handshake")
        if not info.covered and not check.any_version:
            return Result(check, Outcome.SKIP, f"server {info.verdict}; only handshake checks run")
        if info.covered and not check.any_version and not check.applies_to(info.version):
            return Result(check, Outcome.UNSUPPORTED, f"rule of protocol {check.versions_label}; server speaks "
                          f"{info.version_label}")
        return None

    def run_one(self, check: Check) -> Result:
        result = self._not_applicable(check)
        if result is None:
            # A spawned server found dead before the check starts died of something no check explains.
            early = self._unexplained(check) if self.target.process_exited() else []
            result = self._not_applicable(check)
            if result is None:
                ctx = Context(self._facts(), check.id)
                result = self._execute(check, ctx)
                if ctx.gone_before_start and not self.server_alive():
                    # The check's first connect found no server: nothing of it reached the server, so the death
                    # is not its own.  Reported as such; the check runs (once more) on the restarted server.
                    early += self._unexplained(check)
                    result = self._not_applicable(check)
                    if result is None:
                        ctx = Context(self._facts(), check.id)
                        result = self._execute(check, ctx)
                        self._after(check, result)
                else:
                    self._after(check, result)
                self._last_run = check.id
            result.evidence[:0] = early
        result.spec = check.spec_link(self.info.protocol)
        self.results.append(result)
        return result

    def _facts(self) -> RunFacts:
        """What a check may know of this run, as it stands now (a caller may set the seed after construction)."""
        return RunFacts(self.target, self.info, self.timeout, self.seed, self.expect, self.shared)

    def _execute(self, check: Check, ctx: Context) -> Result:
        t0 = time.perf_counter()
        try:
            note = check.func(ctx)
            result = Result(check, Outcome.PASS, note or "")
        except CheckFailed as exc:
            if isinstance(exc, Blocked):
                # The refused request is the harness's setup, not the rule: the rule never ran.  The message is the
                # shared cause, so that the report names it once for every check it blocked.
                result = Result(check, Outcome.BLOCKED, exc.cause)
            else:
                level = exc.level or check.level
                result = Result(check, Outcome.FAIL, exc.message, failed_level=level,
                                interrupted=isinstance(exc, ServerGone) or _lost_connection(exc))
            ctx.evidence.append(exc.evidence)
        except Skipped as exc:
            result = Result(check, Outcome.SKIP, str(exc))
        except Unsupported as exc:
            result = Result(check, Outcome.UNSUPPORTED, str(exc))
        except ConnectionClosed as exc:
            result = self._broken(check, ctx, "the server closed the connection during a valid exchange", exc,
                                  "the reply, connection open")
        except ProtocolError as exc:
            result = self._broken(check, ctx, "the server's reply breaks the framing", exc,
                                  "a reply of the spec's size")
        except TimeoutError as exc:
            result = self._broken(check, ctx, f"no answer within {self.timeout:g} s", exc, "an answer")
        except OSError as exc:
            result = self._broken(check, ctx, "socket error", exc, "a working connection")
        except Exception as exc:  # a bug in the check, reported as such rather than as a server failure
            result = Result(check, Outcome.ERROR, f"check crashed: {type(exc).__name__}: {exc}",
                            failed_level=check.level)
            ctx.note("check crashed", got=f"{type(exc).__name__}: {exc}")
        finally:
            ctx.close_all()
        result.duration = time.perf_counter() - t0
        result.evidence = ctx.evidence
        result.recording = ctx.recorder
        return result

    @staticmethod
    def _broken(check: Check, ctx: Context, what: str, exc: BaseException, expected: str) -> Result:
        """A check interrupted by the server's behaviour: a failure, with the exception as evidence."""
        detail = str(exc) or type(exc).__name__
        ctx.note(what, expected=expected, got=detail)
        return Result(check, Outcome.FAIL, f"{what}: {detail}", failed_level=check.level, interrupted=True)

    def _after(self, check: Check, result: Result) -> None:
        """Make sure the server survived; record a death and restart (spawned) or stop the run."""
        self._sanitizer_reports(check, result)
        if self.server_alive():
            return
        # A spawned server still running may only be slow to answer (or still dumping core): wait for its answer or
        # its exit before judging, so the status names the signal rather than "not answering".
        if self.target.can_restart and self.await_ready(self.target.startup_wait):
            return
        death = self.target.death_info() or {"status": "no longer accepts connections"}
        # The step during which it died: the last one that sent something (later steps only found it gone),
        # else the last step the check noted (not the failure the death itself caused).
        failure_only = result.interrupted and result.evidence and not result.evidence[-1].sent
        noted = result.evidence[:-1] if failure_only else result.evidence
        steps = [e for e in noted if e.sent]
        step = steps[-1] if steps else (noted[-1] if noted else None)
        result.server_death = {**death, "step": step.step if step else None, "sent": step.sent if step else None}
        where = f" during step '{step.step}'" if step else ""
        # Only a spawned server's exit is known; an external one is only seen to stop answering.
        what = "server died" if self.target.process_exited() else "server stopped answering"
        result.evidence.append(Evidence(f"{what}{where}", sent=step.sent if step else None,
                                        expected="the server keeps accepting connections", got=death.get("status")))
        death_line = f"{what}{where} ({death.get('status')})"
        if not result.failed or result.interrupted:
            # The death is the verdict, not the refused connect or the broken read it caused.
            said = f"; check said: {result.message}" if result.message and not result.interrupted else ""
            result.outcome = Outcome.FAIL
            result.message = death_line + said
        else:
            result.message = f"{result.message}; then {death_line}"
        # A death fails the check at the check's own level (a MUST check's "never a crash" is a MUST), whatever
        # level the check's own failure had.
        result.failed_level = check.level
        error = self._revive(check.id, f"server stopped answering after {check.id}")
        if error is not None:
            result.evidence.append(Evidence("restart failed", got=error))

    def _sanitizer_reports(self, check: Check, result: Result) -> None:
        """An instrumented server that printed a sanitizer report during the check and went on (UBSan recovers)
        broke the rule the report names: the check fails at its own level, the report as evidence. A fatal
        report comes with the death (its status names it)."""
        mark = self._sanitizer_mark
        reports = [r for r in self.target.sanitizer_reports(mark) if not r.fatal]
        self._sanitizer_mark = self.target.sanitizer_count
        if not reports:
            return
        for report in reports[:5]:
            result.evidence.append(Evidence("the server's sanitizer reported undefined behaviour",
                                            expected="no sanitizer report", got=report.headline()))
        line = f"the server's sanitizer reported {reports[0].headline()}" + (
            f" (and {len(reports) - 1} more)" if len(reports) > 1 else "")
        result.message = f"{result.message}; {line}" if result.failed and result.message else line
        result.outcome = Outcome.FAIL
        result.failed_level = check.level

    def _unexplained(self, check: Check) -> list[Evidence]:
        """Record a death found before ``check`` started (no check explains it) and restart the server."""
        death = self.target.death_info() or {"status": "no longer accepts connections"}
        after = self._last_run or "the handshake"
        self.unexplained_deaths.append({**death, "after": after, "before": check.id})
        evidence = [Evidence(f"the server was found dead before this check started (after {after}); "
                             "no check explains the death", expected="a running server", got=death.get("status"))]
        error = self._revive(after, f"server stopped answering before {check.id} (after {after})")
        if error is not None:
            evidence.append(Evidence("restart failed", got=error))
        return evidence

    def _revive(self, dead_after: str, stopped: str) -> str | None:
        """Restart a dead server and wait until it answers HELLO; else stop the run (``dead_after``: the last
        check it lived through, ``stopped``: why the rest is not run).  The restart error, or None."""
        error = None
        if self.target.can_restart:
            try:
                self.target.restart()
                # start() only saw the port accept a connection: the next check must find HELLO answered, not
                # lose a race with a server still coming up.
                if not self.await_ready(self.target.startup_wait):
                    info = self.target.death_info() if self.target.process_exited() else None
                    raise TargetError(f"restarted server on {self.target.address} does not answer HELLO"
                                      + (f" ({info['status']})" if info else ""))
                self.shared.clear()
                self.handshake()
                return None
            except TargetError as exc:
                error = str(exc)
        # The remaining checks are not run (not failed); the restart failure is reported once, by the caller.
        self.dead_after = dead_after
        self.stop_reason = stopped + (f"; restart failed: {error}" if error else "")
        return error

    # -- summary --

    def summary(self) -> dict[str, int]:
        counts = {o.value: 0 for o in Outcome}
        must = should = 0
        for r in self.results:
            counts[r.outcome.value] += 1
            if r.failed:
                if r.failed_level is Level.SHOULD:
                    should += 1
                else:
                    must += 1
        return {"total": len(self.results), **counts, "must_failures": must, "should_failures": should}

    def verdict(self, strict: bool = False) -> Verdict:
        """The run's one verdict (see :mod:`.verdict`), which every report and the exit code take."""
        return judge(self.results, covered=self.info.covered or self.info.version is None, server=self.info.verdict,
                     strict=strict, unexplained_deaths=len(self.unexplained_deaths), profile=self.profile)

    def exit_code(self, strict: bool = False) -> int:
        return self.verdict(strict).exit_code


def _lost_connection(exc: BaseException) -> bool:
    """Was this failure raised while handling a broken connection (closed, reset, refused, timed out)?"""
    seen = 0
    cause: BaseException | None = exc.__cause__ or exc.__context__
    while cause is not None and seen < 8:  # `raise ... from None` keeps __context__: still the connection's loss
        if isinstance(cause, (ConnectionClosed, OSError)):
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False
