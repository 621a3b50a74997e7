"""A fuzz campaign: hypothesis runs of the state machine in rounds, against one target, within a budget.

Each round is one hypothesis run (a derived seed, a bounded number of examples).  A finding ends its round after
hypothesis has shrunk it; the reproducer is saved and the campaign goes on with the next round, skipping findings
it already has (same kind on the same command).  A target that died is restarted when the campaign knows how
(embedded or spawned), waited for with ``wait_restart``, or else the campaign says so and stops.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_rpc.conformance.harness import Target
from ggml_rpc.conformance.sessions.replay import ReplayError, replay
from ggml_rpc.reference.config import ServerConfig
from ggml_rpc.spec import CONN_CAPS_SIZE, Command, Protocol, encode_request
from ggml_rpc.spec.codec import REPLY_HEADER_SIZE
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.configuration import set_hypothesis_home_dir, storage_directory
from hypothesis.errors import Flaky
from hypothesis.stateful import get_state_machine_test

from ..user_cache import user_cache
from .channel import Refused, TargetConnection
from .example import Example
from .findings import FuzzFinding, SavedFinding
from .machine import OutOfTime, build_machine
from .memory import return_free_memory as _return_free_memory
from .memory import rss_kib
from .message import FuzzMessage
from .oracle import ModelCache, clear_directory
from .reports import finding_dict
from .saving import FindingStore
from .shadow import READ_TAG
from .targets import cache_unknown

#: Examples per hypothesis run (one round).
ROUND_EXAMPLES = 10
#: Messages per example at most (hypothesis' stateful step count).
STEPS_PER_EXAMPLE = 60


class TargetGone(Exception):
    """The target died and cannot be brought back."""


class BudgetSpent(Exception):
    """The example or time budget is used up (checked between rounds)."""


@dataclass
class Stats:
    examples: int = 0
    messages: int = 0
    broken: int = 0
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    max_rss_kib: int = 0
    #: Resident memory of the target process, when it runs on this machine under the campaign's control.
    max_target_rss_kib: int = 0
    by_command: Counter = field(default_factory=Counter)
    #: Messages sent with a flaw, per kind of flaw (:data:`.nearvalid.FLAWS`) or strategy tag.
    by_flaw: Counter = field(default_factory=Counter)
    #: Reads of the shadow-memory oracle (:mod:`.shadow`) among the messages.
    shadow_reads: int = 0
    #: The example that failed first (1-based): how far the search went before finding something. ``examples``
    #: goes on counting while hypothesis shrinks that failure.
    first_finding_at: int | None = None
    #: Deaths found before an example sent anything of its own (a heap an earlier example corrupted, freed later):
    #: no example's finding, each counted here.
    deaths_between_examples: int = 0

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    @property
    def rate(self) -> float:
        s = self.seconds
        return self.messages / s if s > 0 else 0.0


@dataclass
class Options:
    examples: int | None = None
    seconds: float | None = None
    seed: int = 0
    out_dir: Path | None = None
    timeout: float = 5.0
    wait_restart: float = 0.0
    #: Compare server-specific values (alignment, memory...) exactly: the target is the embedded reference.
    exact: bool = False
    steps: int = STEPS_PER_EXAMPLE
    #: Stop after this many (distinct) findings; None: run the whole budget.
    max_findings: int | None = None
    #: Stop shrinking a finding after this many seconds and keep the smallest failing example seen so far.
    shrink_seconds: float = 60.0
    round_examples: int = ROUND_EXAMPLES
    #: Apply the shadow-memory oracle after every write (:mod:`.shadow`): read back what it must not have touched.
    shadow: bool = True
    #: When the whole run must be over (a ``time.monotonic()`` value: the command's own start plus ``seconds``, so
    #: that setup counts too); None: ``seconds`` after the campaign is made.
    deadline: float | None = None


class Campaign:
    """Fuzz one target with one protocol's state machine; its findings go to the :class:`.saving.FindingStore` it
    holds."""

    def __init__(self, target: Target, protocol: Protocol, model_config: ServerConfig, options: Options, *,
                 devices: int = 1, alignment: int = 32,
                 progress: Callable[[Campaign], None] | None = None,
                 on_finding: Callable[[SavedFinding], None] | None = None) -> None:
        self.target = target
        self.protocol = protocol
        self.model_config = model_config
        self.options = options
        self.devices = devices
        self.alignment = alignment
        self.timeout = options.timeout
        self.exact = options.exact
        self.shadow = options.shadow
        # The model has a hash cache when the target's can be seen and emptied between examples (the embedded
        # target with a cache, an upstream -c the fuzzer spawned with its own LLAMA_CACHE).  A target whose cache
        # the model cannot know may answer SET_TENSOR_HASH with a hit where the model misses: accepted, see
        # :func:`.targets.cache_unknown`.
        self.model_cache = ModelCache() if getattr(target, "use_cache", False) else None
        self.cache_unknown = self.model_cache is None and cache_unknown(target)
        self.stats = Stats()
        self.store = FindingStore(protocol, options.out_dir, on_finding)
        #: Past this moment no message is sent (the example under way turns inert, as after Ctrl-C), a finding being
        #: shrunk keeps its smallest failing example so far, and the run ends.
        self.deadline = options.deadline if options.deadline is not None else \
            None if options.seconds is None else self.stats.started + options.seconds
        self.stopped_because = ""
        self._progress = progress
        self._last_status = 0.0
        self._example: Example | None = None
        self._first_failure: tuple[FuzzFinding, list] | None = None
        self._first_size = 0
        self._shrink_started: float | None = None
        self._dead = False
        #: Why the target cannot be used any more ('' while it can).
        self.gone = ""
        #: Shrinking ran out of time: later examples of the round are inert, the smallest failure is kept.
        self.giving_up = False
        #: Someone asked the campaign to stop (Ctrl-C): examples turn inert, the run ends after this round.
        self.stop_requested = False
        #: The budget ran out inside a round: its remaining examples are inert.
        self.out_of_budget = False
        self._machine = build_machine(self)

    @property
    def findings(self) -> list[SavedFinding]:
        """The findings kept so far, in order."""
        return self.store.findings

    # ---- target liveness ---------------------------------------------------------------------------------------

    def alive(self) -> bool:
        """Does the target accept a connection and answer HELLO?"""
        try:
            conn = TargetConnection(self.target.host, self.target.port, timeout=self.timeout)
        except Refused:
            self._dead = True
            return False
        try:
            hello = encode_request(self.protocol, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})
            conn.send(hello)
            want = REPLY_HEADER_SIZE + self.protocol.commands[Command.HELLO].reply.header_size  # type: ignore[union-attr]
            ok = len(conn.read(want).data) == want
        finally:
            conn.close()
        if not ok:
            self._dead = True
        return ok

    @property
    def seed(self) -> int:
        """What an example asks (:class:`.host.ExampleHost`): the campaign's seed."""
        return self.options.seed

    @property
    def examples_inert(self) -> bool:
        """What an example asks (:class:`.host.ExampleHost`): send nothing more."""
        return bool(self.gone) or self.giving_up or self.stop_requested or self.out_of_budget or self.past_deadline()

    def past_deadline(self) -> bool:
        """The time budget is spent (checked before every message, not only between examples: an example of a
        slow or hanging target can take a minute)."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def request_stop(self) -> None:
        """Stop soon and cleanly (what Ctrl-C does): no new message is sent, the summary is still made."""
        self.stop_requested = True

    def mark_dead(self) -> None:
        """The target is (maybe) down: the next example checks it and brings it back first."""
        self._dead = True

    def dead_before_example(self) -> None:
        """What an example asks (:class:`.host.ExampleHost`): counted, and the target looked at before the next."""
        self.stats.deaths_between_examples += 1
        self._dead = True

    def _revive(self) -> None:
        """Bring a dead target back (restart / wait) or raise TargetGone."""
        if self.target.can_restart:
            self.target.restart()
            self.stats.restarts += 1
            self._dead = False
            if self.alive():
                return
            raise TargetGone("the target did not come back after a restart")
        if self.options.wait_restart > 0:
            deadline = time.monotonic() + self.options.wait_restart
            while time.monotonic() < deadline:
                if self.alive():
                    self._dead = False
                    return
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            raise TargetGone(f"the target did not come back within {self.options.wait_restart:g} s")
        raise TargetGone("the target died (no --spawn to restart it, no --wait-restart)")

    # ---- hooks used by examples --------------------------------------------------------------------------------

    def new_example(self) -> Example:
        if self._first_failure is None and not self.out_of_budget:
            try:
                self._check_budget()
            except BudgetSpent:
                # The rest of the round is inert (a finding being shrunk is still finished first).
                self.out_of_budget = True
        if self._shrink_started is not None and not self.giving_up and \
                time.monotonic() - self._shrink_started > self.options.shrink_seconds:
            self.giving_up = True
        if self._dead and not self.gone and not self.stop_requested and not self.alive():
            try:
                self._revive()
            except TargetGone as exc:
                # Raising through hypothesis would look like a flaky test: later examples are inert instead.
                self.gone = str(exc)
        self._dead = False
        self.clear_caches()
        self._example = Example(self)
        if not self._example.inert:
            self.stats.examples += 1
        return self._example

    def clear_caches(self) -> None:
        """Empty the model's cache and the target's (when the fuzzer owns it): before an example or a replay."""
        if self.model_cache is not None:
            self.model_cache.clear()
        self.clear_target_cache()

    def clear_target_cache(self) -> None:
        """Empty the target's cache folder (when the fuzzer owns it and the model follows it)."""
        cache_dir = self.target.cache_dir if self.model_cache is not None else None
        if cache_dir is not None and cache_dir.exists():
            clear_directory(cache_dir)

    def count_message(self, msg: FuzzMessage) -> None:
        st = self.stats
        st.messages += 1
        st.by_command[msg.name] += 1
        if READ_TAG in msg.tags:
            st.shadow_reads += 1
        if msg.broken:
            st.broken += 1
            st.by_flaw[msg.tags[0] if msg.tags else msg.broken.split(":", 1)[0]] += 1
        if st.messages & 255 == 0:
            now = time.monotonic()
            if now - self._last_status >= 0.5:
                self._last_status = now
                st.max_rss_kib = max(st.max_rss_kib, rss_kib())
                pid = self._target_pid()
                if pid:
                    st.max_target_rss_kib = max(st.max_target_rss_kib, rss_kib(pid))
                if self._progress is not None:
                    self._progress(self)

    def _target_pid(self) -> int | None:
        pid = getattr(self.target, "pid", None)
        if pid is None:
            proc = getattr(self.target, "proc", None)
            pid = getattr(proc, "pid", None)
        return pid

    def found(self, example: Example, finding: FuzzFinding) -> None:
        """Keep the smallest failing example of the round's first kind of failure (what shrinking converges to)."""
        if self.stop_requested:
            return  # after a stop request a failure may be the kit's own termination (the target got the signal)
        first = self._first_failure
        if first is None:
            self._shrink_started = time.monotonic()
            if self.stats.first_finding_at is None:
                self.stats.first_finding_at = self.stats.examples
        elif first[0].signature != finding.signature or example.messages >= self._first_size:
            return
        self._first_failure = (finding, [list(w) for w in example.transcript])
        self._first_size = example.messages

    def _check_budget(self) -> None:
        o = self.options
        if o.examples is not None and self.stats.examples >= o.examples:
            raise BudgetSpent("examples")
        if self.past_deadline():
            raise BudgetSpent("seconds")

    # ---- the run -----------------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Everything ``findings.json`` holds."""
        st = self.stats
        return {"target": self.target.description, "protocol": self.protocol.label, "seed": self.options.seed,
                "examples": st.examples, "messages": st.messages, "seconds": round(st.seconds, 1),
                "messages_per_second": round(st.rate, 1), "restarts": st.restarts,
                "first_finding_at": st.first_finding_at, "deaths_between_examples": st.deaths_between_examples,
                # Restarts that were forks of the spawned server (its fork server), not new processes.
                "fork_restarts": getattr(self.target, "fork_restarts", 0),
                "classes": [finding_dict(f) for f in self.findings]}

    def run(self) -> list[SavedFinding]:
        rounds = 0
        warnings.simplefilter("ignore", RuntimeWarning)  # the model's executor on fuzzed numbers (NaN, inf)
        with _kit_hypothesis_home():
            self._run(rounds)
        return self.findings

    def _run(self, rounds: int) -> None:
        try:
            while True:
                if self.stop_requested:
                    self.stopped_because = "interrupted"
                    break
                try:
                    self._check_budget()
                except BudgetSpent:
                    self.stopped_because = "budget spent"
                    break
                self._round(rounds)
                _return_free_memory()
                if self.options.max_findings is not None and len(self.findings) >= self.options.max_findings:
                    self.stopped_because = f"{len(self.findings)} finding(s)"
                    break
                if self.gone:
                    self._record_unshrunk(self.gone)
                    self.stopped_because = f"target died: {self.gone}"
                    break
                rounds += 1
        finally:
            self._close_example()
            if self.model_cache is not None:
                self.model_cache.remove()
            self.stats.max_rss_kib = max(self.stats.max_rss_kib, rss_kib())

    def _round(self, number: int) -> None:
        s = settings(max_examples=self.options.round_examples, stateful_step_count=self.options.steps,
                     deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                     verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                     print_blob=False)
        test = get_state_machine_test(self._machine, settings=s)
        test = hypothesis_seed(self.options.seed * 1_000_003 + number)(test)
        self._first_failure = None
        self._shrink_started = None
        self.giving_up = False
        try:
            test()
        except OutOfTime:
            # The budget ran out inside the round: a failure being shrunk keeps its smallest example so far.
            self._record_unshrunk("the time budget ran out while shrinking; smallest failing example kept")
            return
        except Exception as exc:  # hypothesis re-raises the shrunk failure (or a group / flaky wrapper of it)
            if self.giving_up or (self._first_failure is not None and self.past_deadline()):
                # Inert examples make hypothesis complain about flakiness: expected, the smallest failure is kept.
                why = "the time budget ran out while shrinking" if not self.giving_up else \
                    f"shrinking stopped after {self.options.shrink_seconds:g} s"
                self._record_unshrunk(f"{why}; smallest failing example kept")
                return
            if self.gone:
                return  # run() records the failure and stops
            if _find_finding(exc) is None:
                if not isinstance(exc, Flaky):
                    raise
                # A target that dies at slightly different moments makes the same choices lead elsewhere:
                # hypothesis gives up replaying; the smallest failing example seen is still a reproducer.
                self._record_unshrunk("the target did not fail the same way twice (timing); smallest failing "
                                      "example kept")
                return
            ex = self._example
            if ex is not None and ex.finding is not None:
                self._save(ex.finding, ex.transcript, shrunk=True)
            else:
                self._record_unshrunk("the shrunk example did not reproduce")
        finally:
            self._close_example()

    # ---- findings ----------------------------------------------------------------------------------------------

    def _replay_fails(self, pcap: Path | None, kind: str) -> bool:
        """Does ``ggml-rpc replay``'s engine, re-running ``pcap`` against the target, fail (the target dies again
        after a crash -- on a restarted target --, or its replies differ)?"""
        if pcap is None:
            return False
        try:
            if kind == "crash":
                self.target.restart()
                self.stats.restarts += 1
            self.clear_caches()  # ``replay`` models a target cache that starts empty, as the example's did
            report = replay([pcap], self.target.host, self.target.port, timeout=self.timeout)
            failed = not report.ok
        except ReplayError:
            failed = True
        except Exception:  # a reproducer that does not even replay is simply not kept
            return False
        finally:
            self._dead = True  # make the next example check (and bring back) the target
        return not self.alive() if kind == "crash" else failed

    def _record_unshrunk(self, why: str) -> None:
        if self._first_failure is None:
            return
        finding, transcript = self._first_failure
        self._first_failure = None
        saved = self._save(finding, transcript, shrunk=False)
        if saved is not None:
            saved.notes.append(f"not shrunk: {why}")

    def _save(self, finding: FuzzFinding, transcript: list, *, shrunk: bool) -> SavedFinding | None:
        if self.stop_requested:
            # Stopping: the failure may be the kit's own termination (a process group's signal reaches a target
            # the kit started too), and re-verifying it would outlast the 2 s a stop may take.
            return None
        return self.store.save(finding, transcript, shrunk=shrunk, replay_fails=self._replay_fails,
                               can_restart=self.target.can_restart, out_of_time=self.past_deadline())

    def _close_example(self) -> None:
        ex = self._example
        if ex is not None:
            with contextlib.suppress(Exception):
                if ex.tconn is not None:
                    ex.tconn.close()
                for m in ex.models.values():
                    m.close()


@contextlib.contextmanager
def _kit_hypothesis_home() -> Iterator[None]:
    """Hypothesis' own files go to the kit's user cache, not to ``.hypothesis/`` in whatever folder the user runs
    the fuzzer from. Without an example database the only ones are its cache of the constants of local source files
    (content-addressed): in a per-campaign folder they were mined again by every campaign, a 2-3 s parse of the
    kit's modules on an editable install, inside the first examples, where no interrupt is seen."""
    previous = storage_directory(intent_to_write=False).home_directory
    set_hypothesis_home_dir(user_cache("hypothesis"))
    try:
        yield
    finally:
        set_hypothesis_home_dir(previous)


def _find_finding(exc: BaseException) -> FuzzFinding | None:
    if isinstance(exc, FuzzFinding):
        return exc
    for sub in getattr(exc, "exceptions", ()) or ():
        found = _find_finding(sub)
        if found is not None:
            return found
    cause = exc.__cause__ or exc.__context__
    return _find_finding(cause) if cause is not None else None


__all__ = ["BudgetSpent", "Campaign", "Options", "Stats", "TargetGone", "rss_kib"]
