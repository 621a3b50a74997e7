"""The one verdict of a conformance run: its state, exit code, line and per-result labels.

Every report (terminal, JSON, JUnit, SARIF, HTML) and the exit code of ``ggml-rpc check`` take the verdict from
:func:`judge`, so that no format re-derives it and two formats cannot disagree.

States, in the order they win:

- **not conformant** (exit 1): a MUST rule failed, a check crashed (a kit bug), the server died (during a check,
  or between checks), or, with ``--strict``, a SHOULD rule failed.  A death fails its check at the check's own
  level: "never a crash" is the rule the check states, not a lesser one.
- **not covered** (exit 3): the server announces a protocol version the kit has no table for (``protocol_for``
  returns None), so only the handshake could be judged.
- **incomplete** (exit 4): the server refused the harness's own setup (e.g. the 4096-byte buffer most checks write
  into): the checks it blocked never ran their rule.
- **conformant** (exit 0): none of the above.

Exit code 2 stays every command's usage error (bad option, unreachable server) and 130 an interrupt.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ggml_rpc.spec.rules import Level

from .model import Outcome, Result


class State(enum.Enum):
    CONFORMANT = "conformant"
    NOT_CONFORMANT = "not conformant"
    NOT_COVERED = "not covered"
    INCOMPLETE = "incomplete"


#: ``ggml-rpc check``'s exit code per state.
EXIT_CODES = {State.CONFORMANT: 0, State.NOT_CONFORMANT: 1, State.NOT_COVERED: 3, State.INCOMPLETE: 4}
#: Every command's exit code for a user mistake (bad option, unreachable server, unwritable report).
EXIT_USAGE = 2
#: Every command's exit code when stopped by SIGINT or SIGTERM (the shell's 128 + SIGINT).
EXIT_INTERRUPTED = 130

#: What each state means, for the reports' legend and ``--help``.
STATE_MEANING = {
    State.CONFORMANT: "every applicable MUST rule passed, nothing died, and every selected check could judge the "
                      "server",
    State.NOT_CONFORMANT: "a MUST rule failed, the server died, or a check crashed (--strict: a SHOULD rule failed)",
    State.NOT_COVERED: "the server announces a protocol version this kit does not cover; only the handshake was "
                       "judged",
    State.INCOMPLETE: "the server refused the harness's own setup; the checks it blocked never ran their rule",
}

#: The checks whose failure is a disclosure of memory (another allocation's bytes): counted as leaks on the verdict
#: line beside deaths.  Listed here rather than flagged in the catalogue so that the robustness count has one home.
LEAK_CHECKS = frozenset({"DATA-030"})

#: What each result label means: the legend of the HTML report, the README and ``--help``.
LEGEND: tuple[tuple[str, str], ...] = (
    ("pass", "the rule held"),
    ("fail", "the server broke the rule; a MUST failure fails the run, a SHOULD failure only with --strict"),
    ("died", "the server died during the check (signal or exit named): the check fails at its own level, and any "
             "death fails the run"),
    ("error", "the check itself crashed (a bug in the kit); fails the run"),
    ("blocked", "the server refused the harness's own setup (named once on the verdict line); the rule never ran"),
    ("skip", "the check cannot judge this server: an optional feature is absent (no hash cache, one connection at "
             "a time) or the server's version is not covered"),
    ("unsupported", "a rule of another protocol version, or an op the server declines while it computes others"),
    ("not run", "the run stopped before the check: the server died and could not be restarted"),
)


@dataclass(frozen=True, slots=True)
class Profile:
    """A named part of the catalogue run in place of all of it (``check --profile``).  A run of a profile is
    partial: its verdict names the profile and how many checks it left out, and "conformant" there never means
    conformant to the whole spec."""

    name: str
    #: What the profile holds, in words (reports show it).
    meaning: str
    #: Checks of the selection the profile left out.
    left_out: int


#: ``check --profile NAME``: what each profile holds.
PROFILES = {
    "safe": "only requests valid per the spec and harmless to every build the kit knows (no malformed input, no "
            "input of a known upstream crash): for a server someone depends on",
}


def died(r: Result) -> bool:
    """Did the server die during this check (the death is then the check's failure)?"""
    return r.server_death is not None and r.failed


def death_status(r: Result) -> str | None:
    """"killed by signal SIGSEGV", "exited with code 3", "no longer accepts connections"; None without a death."""
    return str(r.server_death.get("status")) if died(r) and r.server_death else None


def kind(r: Result) -> str:
    """The result's label in the legend: pass, fail, died, error, blocked, skip, unsupported, not run."""
    if died(r):
        return "died"
    return r.outcome.value


def label(r: Result) -> str:
    """A short label for tables: ``pass``, ``fail (SHOULD)``, ``died (MUST)``, ``blocked``..."""
    k = kind(r)
    if r.failed and r.outcome is not Outcome.ERROR:
        level = (r.failed_level or r.check.level).value
        return f"{k} ({level})"
    return k


def reason(r: Result) -> str:
    """One line saying why a result is not a pass (the first line of its message)."""
    return (r.message or r.outcome.value).splitlines()[0]


@dataclass(frozen=True, slots=True)
class Verdict:
    state: State
    strict: bool
    #: The server's announced version in words ("speaks 7.0", "speaks 9.0.0: not covered by this kit").
    server: str
    must_failures: int = 0
    should_failures: int = 0
    errors: int = 0
    #: Deaths during checks, and deaths found between checks that no check explains.
    deaths: int = 0
    unexplained_deaths: int = 0
    leaks: int = 0
    blocked: int = 0
    not_run: int = 0
    #: Checks skipped because the version is not covered.
    not_covered: int = 0
    #: The distinct setup refusals behind the blocked checks, each with how many checks it blocked.
    setup_refusals: tuple[tuple[str, int], ...] = ()
    #: The results that made the verdict what it is (failures, deaths, errors), in run order.
    failures: tuple[Result, ...] = field(default=(), repr=False)
    #: The profile run in place of the whole selection (a partial run), or None.
    profile: Profile | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.state]

    @property
    def title(self) -> str:
        """The state as the verdict line shows it (upper case where the run failed, to stand out; a profile's
        conformance is named as the profile's)."""
        if self.state is State.NOT_CONFORMANT:
            return "NOT conformant" + (f" (on the {self.profile.name} profile)" if self.profile else "")
        if self.profile is not None:
            return f"{self.state.value} on the {self.profile.name} profile"
        return self.state.value

    @property
    def robustness(self) -> str:
        deaths = self.deaths + self.unexplained_deaths
        return f"robustness: {deaths} death{'s' * (deaths != 1)}, {self.leaks} leak{'s' * (self.leaks != 1)}"

    def reasons(self) -> list[str]:
        """Why the state is what it is, in words (empty for a conformant run)."""
        out = []
        if self.must_failures:
            out.append(f"{self.must_failures} MUST failure{'s' * (self.must_failures != 1)}")
        if self.should_failures and (self.strict or self.state is State.NOT_CONFORMANT):
            out.append(f"{self.should_failures} SHOULD failure{'s' * (self.should_failures != 1)}")
        if self.deaths:
            out.append(f"the server died in {self.deaths} check{'s' * (self.deaths != 1)}")
        if self.unexplained_deaths:
            out.append(f"{self.unexplained_deaths} death(s) between checks")
        if self.errors:
            out.append(f"{self.errors} check error{'s' * (self.errors != 1)} (a kit bug)")
        if self.state is State.NOT_COVERED or self.not_covered:
            out.append(f"the server {self.server.removeprefix('speaks ')}; {self.not_covered} check(s) could not "
                       "judge it")
        for cause, n in self.setup_refusals:
            out.append(f"setup refused: {cause} ({n} check{'s' * (n != 1)} blocked)")
        if self.not_run:
            out.append(f"{self.not_run} check(s) not run")
        return out

    def line(self) -> str:
        """The verdict line: state, why, what a profile left out, and the robustness counts."""
        why = "; ".join(self.reasons())
        strict = " (strict)" if self.strict else ""
        partial = (f" ({self.profile.left_out} checks left out: a partial run, not full conformance)"
                   if self.profile is not None else "")
        return f"→ {self.title}{strict}{partial}" + (f": {why}" if why else "") + f" — {self.robustness}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "exit_code": self.exit_code,
            "line": self.line(),
            "meaning": STATE_MEANING[self.state],
            "strict": self.strict,
            "reasons": self.reasons(),
            "must_failures": self.must_failures,
            "should_failures": self.should_failures,
            "errors": self.errors,
            "deaths": self.deaths,
            "unexplained_deaths": self.unexplained_deaths,
            "leaks": self.leaks,
            "blocked": self.blocked,
            "not_run": self.not_run,
            "not_covered": self.not_covered,
            "setup_refusals": [{"cause": c, "blocked": n} for c, n in self.setup_refusals],
            "failures": [r.check.id for r in self.failures],
            "profile": self.profile.name if self.profile else None,
            "profile_meaning": self.profile.meaning if self.profile else None,
            "checks_left_out": self.profile.left_out if self.profile else 0,
        }


def judge(results: Sequence[Result], *, covered: bool, server: str = "", strict: bool = False,
          unexplained_deaths: int = 0, profile: Profile | None = None) -> Verdict:
    """The verdict of a run: ``covered`` is whether the kit has a table for the server's version."""
    failed = [r for r in results if r.failed]
    must = sum(1 for r in failed if (r.failed_level or r.check.level) is Level.MUST)
    should = len(failed) - must
    errors = sum(1 for r in failed if r.outcome is Outcome.ERROR)
    deaths = sum(1 for r in results if died(r))
    leaks = sum(1 for r in failed if r.check.id in LEAK_CHECKS)
    blocked = [r for r in results if r.outcome is Outcome.BLOCKED]
    refusals: dict[str, int] = {}
    for r in blocked:
        refusals[reason(r)] = refusals.get(reason(r), 0) + 1
    not_run = sum(1 for r in results if r.outcome is Outcome.NOT_RUN)
    uncovered = 0 if covered else sum(1 for r in results if r.outcome is Outcome.SKIP)
    if must or errors or deaths or unexplained_deaths or (strict and should):
        state = State.NOT_CONFORMANT
    elif not covered:
        state = State.NOT_COVERED
    elif blocked:
        state = State.INCOMPLETE
    else:
        state = State.CONFORMANT
    return Verdict(state, strict, server, must, should, errors, deaths, unexplained_deaths, leaks, len(blocked),
                   not_run, uncovered, tuple(refusals.items()), tuple(failed), profile)
