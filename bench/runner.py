"""The benchmark runner behind ``ggml-rpc bench``: interleaved samples, robust statistics, the JSON record.

A *measurement* measures one figure (SET_TENSOR throughput at one size, round trips per second...) on one target at
a time: :meth:`Measurement.prepare` does the untimed setup for a target and returns its state, :meth:`~Measurement.
sample` times one repetition and returns the figure's value, :meth:`~Measurement.finish` releases what prepare took.
The runner prepares every target, takes one untimed warm-up sample of each, then takes the timed samples round by
round, one per target in turn (A B A B ...), so that drift of a shared machine (other processes, CPU frequency)
lands on every target alike instead of on whichever ran last.

Statistics are the median (robust to the odd descheduled sample), the spread as the median absolute deviation in
percent of the median, and the ratio of every target's median to the first target's, oriented so that above 1 always
means "faster than the first target" whatever the unit.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ggml_rpc.conformance import kit_version
from ggml_rpc.conformance.provenance import git_state

State = TypeVar("State")

#: Bumped when the JSON record changes shape (BENCHMARKS.md documents it).
JSON_SCHEMA = 2
#: Goals are the project's own objectives: they are judged on the reference server's and the kit's results only.
GOAL_TARGETS = ("reference", "kit")


class NotApplicable(Exception):
    """The figure cannot be taken on this target (no cache, version without the command...); the text says why."""


@dataclass(frozen=True)
class Figure:
    """What a measurement reports."""

    key: str
    label: str
    unit: str
    #: True for rates (MB/s, round trips/s), False for durations (ms).
    higher_is_better: bool = True
    #: An objective the project set itself for the reference server or the kit: (comparison, value, source).
    goal: tuple[str, float, str] | None = None

    def goal_met(self, value: float) -> bool | None:
        if self.goal is None:
            return None
        op, bound, _ = self.goal
        return value >= bound if op == ">=" else value <= bound


class Measurement(Generic[State]):
    """One figure, measured on any number of targets; subclasses implement prepare/sample/finish."""

    figure: Figure

    def prepare(self, target: Any) -> State:
        raise NotImplementedError

    def sample(self, state: State) -> float:
        raise NotImplementedError

    def finish(self, state: State) -> None:
        """Release what :meth:`prepare` took (connections, buffers, files)."""


@dataclass
class SampleStats:
    median: float
    minimum: float
    maximum: float
    #: Median absolute deviation, in percent of the median.
    spread_pct: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> SampleStats:
        med = statistics.median(samples)
        mad = statistics.median(abs(s - med) for s in samples)
        return cls(med, min(samples), max(samples), 100.0 * mad / med if med else 0.0)


@dataclass
class TargetResult:
    """One figure on one target."""

    target: str
    samples: list[float] = field(default_factory=list)
    #: Why the figure was not taken here (a property of the target, e.g. "no cache"): shown as n/a.
    not_applicable: str | None = None
    #: What went wrong while taking it (connection closed, wrong result...): shown as an error.
    error: str | None = None
    #: Speed relative to the first target that has a value (above 1: faster).
    ratio: float | None = None

    @property
    def stats(self) -> SampleStats | None:
        return SampleStats.of(self.samples) if self.samples and self.error is None else None

    def as_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "target": self.target,
            "median": s.median if s else None,
            "min": s.minimum if s else None,
            "max": s.maximum if s else None,
            "spread_pct": s.spread_pct if s else None,
            "ratio": self.ratio,
            "samples": list(self.samples),
            "not_applicable": self.not_applicable,
            "error": self.error,
        }


@dataclass
class FigureResult:
    figure: Figure
    results: list[TargetResult]

    def as_dict(self) -> dict[str, Any]:
        f = self.figure
        goal = None
        if f.goal is not None:
            own = next((r.stats for r in self.results if r.target in GOAL_TARGETS and r.stats is not None), None)
            goal = {"op": f.goal[0], "value": f.goal[1], "source": f.goal[2],
                    "met": f.goal_met(own.median) if own is not None else None}
        return {"key": f.key, "label": f.label, "unit": f.unit,
                "better": "higher" if f.higher_is_better else "lower", "goal": goal,
                "results": [r.as_dict() for r in self.results]}


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


def _set_ratios(fr: FigureResult) -> None:
    base = next((r.stats.median for r in fr.results if r.stats is not None and r.stats.median > 0), None)
    for r in fr.results:
        s = r.stats
        if base is None or s is None or s.median <= 0:
            continue
        r.ratio = s.median / base if fr.figure.higher_is_better else base / s.median


#: Called after every step: (figure label, target name, steps done in this figure, steps of this figure).
ProgressFn = Callable[[str, str, int, int], None]


def steps_of(repeat: int, targets: int) -> int:
    """Progress steps of one figure: a prepare+warm-up per target, then ``repeat`` samples per target."""
    return targets * (repeat + 1)


def run_measurement(
    measurement: Measurement[Any], targets: Sequence[Any], names: Sequence[str], repeat: int,
    progress: ProgressFn | None = None,
) -> FigureResult:
    """Prepare every target, warm each up, then take ``repeat`` samples per target interleaved; always finishes."""
    label = measurement.figure.label
    total = steps_of(repeat, len(targets))
    done = 0
    results = [TargetResult(name) for name in names]
    states: dict[int, Any] = {}

    def step(name: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(label, name, done, total)

    try:
        for i, target in enumerate(targets):
            try:
                states[i] = measurement.prepare(target)
                measurement.sample(states[i])
            except NotApplicable as exc:
                results[i].not_applicable = str(exc)
            except Exception as exc:  # a misbehaving server is a result, not a crash of the bench
                results[i].error = _describe(exc)
            step(names[i])
        for _ in range(repeat):
            for i in range(len(targets)):
                if i in states and results[i].error is None and results[i].not_applicable is None:
                    try:
                        results[i].samples.append(measurement.sample(states[i]))
                    except NotApplicable as exc:
                        results[i].not_applicable = str(exc)
                    except Exception as exc:
                        results[i].error = _describe(exc)
                step(names[i])
    finally:
        for i, state in states.items():
            try:
                measurement.finish(state)
            except Exception as exc:
                if results[i].error is None and not results[i].samples:
                    results[i].error = _describe(exc)
    fr = FigureResult(measurement.figure, results)
    _set_ratios(fr)
    return fr


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def samples(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds each of ``repeat`` calls of ``fn`` takes."""
    return [timed(fn) for _ in range(repeat)]


def machine() -> dict[str, Any]:
    """Where the figures were taken (kept in the JSON record)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    commit, dirty = git_state()
    return {"kit_version": kit_version(), "commit": commit, "dirty": dirty, "python": sys.version.split()[0],
            "platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average": load}


def record(
    targets: Sequence[dict[str, Any]], server: Sequence[FigureResult], kit: Sequence[FigureResult], *, quick: bool,
    repeat: int, started: float, seconds: float, command: str, bulk_comparisons: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The JSON document ``--json`` writes (shape documented in BENCHMARKS.md)."""
    return {
        "schema": JSON_SCHEMA,
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(seconds, 3),
        "quick": quick,
        "repeat": repeat,
        "machine": machine(),
        "targets": list(targets),
        "server_figures": [f.as_dict() for f in server],
        "kit_figures": [f.as_dict() for f in kit],
        "bulk_comparisons": list(bulk_comparisons),
    }


__all__ = [
    "GOAL_TARGETS",
    "JSON_SCHEMA",
    "Figure",
    "FigureResult",
    "Measurement",
    "NotApplicable",
    "ProgressFn",
    "TargetResult",
    "SampleStats",
    "machine",
    "record",
    "run_measurement",
    "steps_of",
    "timed",
]
