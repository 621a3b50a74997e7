"""Terminal report of a conformance run: one live progress line per group, then the final table.

Built on rich: on a terminal the current group's line updates in place; elsewhere (CI logs, pipes) each group
prints one plain line when it completes.  Failures are listed after the table with their evidence.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .context import ServerInfo
from .model import Category, Check, Outcome, Result, iter_groups
from .runner import Runner
from .verdict import State, Verdict, died
from .verdict import label as verdict_label

STYLE = {
    Outcome.BLOCKED: "bold yellow",
    Outcome.PASS: "green",
    Outcome.FAIL: "bold red",
    Outcome.ERROR: "bold magenta",
    Outcome.SKIP: "yellow",
    Outcome.UNSUPPORTED: "cyan",
    Outcome.NOT_RUN: "dim",
}


def outcome_label(r: Result) -> str:
    """The result's label, as every format shows it (:func:`.verdict.label`)."""
    return verdict_label(r)


def _counts(results: Sequence[Result]) -> str:
    parts = []
    for o in Outcome:
        n = sum(1 for r in results if r.outcome is o)
        if n:
            parts.append(f"{n} {o.value}")
    return ", ".join(parts) or "nothing run"


class Progress:
    """The live per-group line; call :meth:`update` with every result, :meth:`close` at the end."""

    def __init__(self, console: Console, total: dict[Category, int]) -> None:
        self.console = console
        self.total = total
        self.group: Category | None = None
        self.results: list[Result] = []
        self.live: Live | None = None

    def _line(self, done: bool) -> Text:
        assert self.group is not None
        n, total = len(self.results), self.total.get(self.group, 0)
        failed = any(r.failed for r in self.results)
        # A group whose checks could not run is no success: no tick beside "not run".
        not_run = any(r.outcome is Outcome.NOT_RUN for r in self.results)
        mark = "…" if not done else "✗" if failed else "–" if not_run else "✓"
        text = Text(f"{mark} {self.group.value:<10} {n:>3}/{total:<3} ")
        text.append(_counts(self.results), style="red" if failed else "yellow" if not_run else "")
        return text

    def _finish_group(self) -> None:
        if self.group is None:
            return
        if self.live is not None:
            self.live.update(self._line(True))
            self.live.stop()
            self.live = None
        else:
            self.console.print(self._line(True))

    def update(self, result: Result) -> None:
        cat = result.check.category
        if cat is not self.group:
            self._finish_group()
            self.group, self.results = cat, []
            if self.console.is_terminal:
                self.live = Live(self._line(False), console=self.console, transient=False, auto_refresh=False)
                self.live.start()
        self.results.append(result)
        if self.live is not None:
            self.live.update(self._line(False), refresh=True)

    def close(self) -> None:
        self._finish_group()
        self.group = None


def header(console: Console, target_description: str, address: str, info: ServerInfo) -> None:
    where = "" if address in target_description else f" ({address})"  # "server at HOST:PORT" names it already
    console.print(f"[bold]ggml-rpc check[/bold] {escape(target_description)}{where}: HELLO "
                  f"{info.version_label} → [bold]{escape(info.verdict)}[/bold]"
                  + (f", {info.device_count} device(s)" if info.device_count else ""), soft_wrap=True)


def results_table(results: Sequence[Result]) -> Table:
    table = Table(show_lines=False, header_style="bold", expand=False)
    table.add_column("ID", no_wrap=True)
    table.add_column("level", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("rule / why")
    for cat, group in iter_groups(results):
        table.add_row(Text(cat.value, style="bold"), "", "", "")
        for r in group:
            why = r.check.title
            if r.outcome is not Outcome.PASS and r.message:
                why += f"\n[{r.outcome.value}] {r.message}"
            table.add_row(r.check.id, r.check.level.value, Text(outcome_label(r), style=STYLE[r.outcome]),
                          Text(why))
    return table


def failure_details(console: Console, results: Sequence[Result]) -> None:
    failed = [r for r in results if r.failed]
    for r in failed:
        console.print(Text(f"\n{r.check.id} {outcome_label(r).upper()}: {r.message}", style=STYLE[r.outcome]),
                      soft_wrap=True)
        if died(r) and r.server_death:
            d = r.server_death
            console.print(f"  death: {d.get('status')} during step {d.get('step') or '(unknown)'}"
                          + (f"; bytes sent: {d['sent']}" if d.get("sent") else ""),
                          soft_wrap=True, markup=False, highlight=False)
        console.print(f"  rule: {r.check.title} ({r.check.level.value}) — {r.spec}", soft_wrap=True, markup=False)
        for e in r.evidence:
            console.print(f"  - {e.step}", soft_wrap=True, markup=False)
            for label, value in (("sent", e.sent), ("expected", e.expected), ("got", e.got)):
                if value:
                    console.print(f"      {label:<8} {value}", markup=False, highlight=False, soft_wrap=True)
        if r.server_death and r.server_death.get("log_tail"):
            console.print("  server log (last lines):")
            for line in r.server_death["log_tail"][-10:]:
                console.print(f"      {line}", markup=False, highlight=False, soft_wrap=True)


def setup_errors(console: Console, runner: Runner) -> None:
    """One error per distinct setup refusal, instead of a failure per check it blocked."""
    for cause, n in runner.verdict().setup_refusals:
        console.print(Text(f"\nsetup error: the server refused the harness's own setup: {cause} — {n} "
                           f"check{'s' * (n != 1)} blocked (their rules never ran)", style="bold yellow"),
                      soft_wrap=True)


def not_run_advice(runner: Runner) -> str | None:
    """For a run that stopped early because a server the kit cannot restart died: how many checks could not run
    and how ``--spawn`` runs them all (None otherwise)."""
    not_run = sum(1 for r in runner.results if r.outcome is Outcome.NOT_RUN)
    if not not_run or runner.target.can_restart:
        return None
    after = f" after {runner.dead_after}" if runner.dead_after else ""
    return (f"{not_run} check{'s' * (not_run != 1)} could not run: the server at {runner.target.address} stopped "
            f"answering{after}, and the kit cannot restart a server it did not start. Let it start the server "
            "(ggml-rpc check --spawn 'CMD ... {port}'): each death is then named, the server restarted, and every "
            "check runs; or check it with --profile safe (no input of a known crash).")


def summary_line(runner: Runner, strict: bool) -> Text:
    """The counts, then the verdict line (:meth:`.verdict.Verdict.line`)."""
    s = runner.summary()
    text = Text(f"\n{s['total']} checks: {s['pass']} pass, {s['fail']} fail, {s['error']} error, "
                f"{s['blocked']} blocked, {s['skip']} skip, {s['unsupported']} unsupported, {s['not run']} not run — "
                f"MUST failures {s['must_failures']}, SHOULD failures {s['should_failures']}\n")
    return text.append_text(verdict_text(runner.verdict(strict)))


def verdict_text(verdict: Verdict) -> Text:
    """The verdict line with its exit code, coloured by state (all that ``check --quiet`` prints of a pass)."""
    style = {State.CONFORMANT: "bold green", State.NOT_CONFORMANT: "bold red"}.get(verdict.state, "bold yellow")
    text = Text(verdict.line(), style=style)
    text.append(f" (exit code {verdict.exit_code})")
    return text


def catalogue_table(checks: Sequence[Check]) -> Table:
    """``--list``: the catalogue as a table."""
    table = Table(header_style="bold")
    for col in ("ID", "level", "versions", "category", "title", "spec"):
        table.add_column(col, no_wrap=col in ("ID", "level", "versions", "category"))
    for c in checks:
        table.add_row(c.id, c.level.value, c.versions_label, c.category.value, c.title, c.spec_link(None))
    return table
