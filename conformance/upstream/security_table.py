"""The class table: each known upstream report (:mod:`.known_bugs`) against every installed peer, plain and
instrumented, measured by running its checks (``ggml-rpc upstream security``).

1. Measuring: for each peer, ``ggml-rpc check --spawn`` of the table's checks against a fresh server with its own
   ``LLAMA_CACHE`` (raw JSON kept); each failing check's exchange is its reproducer, replayed with ``replay --spawn``
   against another fresh server of the same build: it is *verified* when that server dies (or reports) again.
2. Judging a report on a peer: any of its checks failing is *rediscovered* (how: the signal, the sanitizer's class,
   or the failure), all passing is *fixed*, all not applicable to the version is *n/a*; no check: *hunt only*.
3. Rendering: ``SECURITY.md``'s table, naming the commit, the tree state and the raw JSON it came from.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...reference import running_server
from ..checks import by_id
from ..checks.shadow import SHADOW_CHECKS
from ..sessions.replay import replay
from .known_bugs import CLASSES, KNOWN_BUGS, NEW_BUGS, KnownBug, all_checks, explained_by
from .peers import Peer
from .runs import UpstreamServer, kit

TITLE = ("# Security: upstream's known RPC memory-safety reports, rediscovered or shown fixed, and what the kit "
         "found that no report names")
#: Reproducers larger than this stay in the run folder only (FRAME-038's 300,000-tensor graph is 89 MB).
MAX_KEPT_REPRODUCER = 1 << 20

Say = Callable[[str], None]


def measure_peer(peer: Peer, out_dir: Path, *, checks: list[str] | None = None, say: Say = print) -> dict[str, Any]:
    """Run the table's checks against ``peer``; its record: the check report, and per failing check whether the
    reproducer failed a fresh server again."""

    def command(llama_cache: Path) -> str:
        server = UpstreamServer(peer, cache=True, llama_cache=llama_cache)
        server.cache_dir.mkdir(parents=True, exist_ok=True)
        return server.spawn_command()

    return measure_command(peer.label, peer.version, command, out_dir, sanitize=peer.sanitize, checks=checks,
                           say=say)


def user_command(command: str) -> Callable[[Path], str]:
    """A server command line given by the user (``{port}`` placeholder), run with its own ``LLAMA_CACHE``."""
    import shlex

    def with_cache(llama_cache: Path) -> str:
        (llama_cache / "rpc").mkdir(parents=True, exist_ok=True)
        return f"env LLAMA_CACHE={shlex.quote(str(llama_cache))} {command}"

    return with_cache


def measure_command(label: str, version: str, command_for: Callable[[Path], str], out_dir: Path, *,
                    sanitize: str = "", checks: list[str] | None = None, say: Say = print) -> dict[str, Any]:
    """Run the table's checks against the server ``command_for(llama_cache)`` starts (a fresh one per run)."""
    checks = checks or all_checks()
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / f"{label}.json"
    pcaps = out_dir / f"{label}-pcaps"
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-security-") as tmp:
        say(f"  {label}: {len(checks)} checks")
        done = kit("check", "--spawn", command_for(Path(tmp)), "--checks", ",".join(checks), "--json",
                   str(report_path), "--pcap-dir", str(pcaps), timeout=1800)
    if not report_path.is_file():
        raise RuntimeError(f"check against {label} wrote no report: {done.why()}")
    report = json.loads(report_path.read_text())
    verified: dict[str, bool] = {}
    for result in report["results"]:
        if result["outcome"] != "fail" or not (result.get("server_death") or _sanitizer_failure(result)):
            continue
        pcap = pcaps / f"{result['id']}.pcap"
        if pcap.is_file():
            verified[result["id"]] = _replays_the_failure(command_for, pcap)
    return {"peer": label, "version": version, "sanitize": sanitize, "report": report_path.name,
            "exit_code": done.code, "verified": verified, "target": report.get("server", {}).get("target", "")}


def _sanitizer_failure(result: dict[str, Any]) -> bool:
    return "sanitizer reported" in result.get("message", "")


def _replays_the_failure(command_for: Callable[[Path], str], pcap: Path) -> bool:
    """Does the check's exchange kill (or make report) a fresh server of the same build again?"""
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-security-") as tmp:
        out = Path(tmp) / "replay.json"
        kit("replay", str(pcap), "--spawn", command_for(Path(tmp) / "cache"), "--timeout", "10", "--json",
            str(out), timeout=600)
        if not out.is_file():
            return False
        mismatches = json.loads(out.read_text()).get("mismatches", [])
    return any(m["kind"] in ("death", "sanitizer") for m in mismatches)


def keep_reproducers(record: dict[str, Any], run_dir: Path, dest: Path) -> list[dict[str, Any]]:
    """Copy the verified reproducers (small enough) to ``dest`` (``fixtures/repro/security/``); their entries."""
    kept = []
    for stale in dest.glob(f"{record['peer']}-*.pcap"):
        stale.unlink()  # the folder holds what this run verified, not what an earlier one did
    for check_id, ok in sorted(record["verified"].items()):
        src = run_dir / f"{record['peer']}-pcaps" / f"{check_id}.pcap"
        if not ok or not src.is_file() or src.stat().st_size > MAX_KEPT_REPRODUCER:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / f"{record['peer']}-{check_id}.pcap"
        shutil.copyfile(src, target)
        kept.append({"file": target.name, "peer": record["peer"], "check": check_id, "verified": True})
    return kept


def keep_hunt_reproducers(hunt: dict[str, Any], dest: Path) -> list[dict[str, Any]]:
    """Copy the reproducers of a hunt's verified classes that no report explains to ``dest/hunt-<peer>/``
    (``fixtures/repro/security/``), each only when it replays clean against the reference server of its version
    (what the class's ``kept`` then names; ``not_kept`` says why not); their entries."""
    folder = dest / f"hunt-{hunt['peer']}"
    version = re.search(r"(\d+)\.\d+\.\d+", hunt["peer"])
    kept = []
    for c in hunt["classes"]:
        if not c["verified"] or explained_by(c) is not None:
            continue
        if version is None:
            c["not_kept"] = f"no protocol version in the hunt's label {hunt['peer']!r} to replay it against"
            continue
        major = version.group(1)
        src = Path(c.get("reproducer") or "")
        if not src.is_file() or src.stat().st_size > MAX_KEPT_REPRODUCER:
            c["not_kept"] = "no reproducer small enough"
            continue
        with running_server(major) as srv:
            report = replay([src], srv.host, srv.port, timeout=10)
        if not report.ok:
            c["not_kept"] = "does not replay clean against the reference: " + "; ".join(
                m.line() for m in report.mismatches[:2])
            continue
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / src.name
        if not target.exists() or not target.samefile(src):  # a hunt kept there already (an earlier run's)
            shutil.copyfile(src, target)
        c["kept"] = target.as_posix()
        kept.append({"file": target.as_posix(), "peer": hunt["peer"], "class": c["class"], "verified": True})
    return kept


def judge(bug: KnownBug, results: dict[str, dict[str, Any]], verified: dict[str, bool], major: int = 0, *,
          found: str = "rediscovered") -> str:
    """One cell: what the peer's results for the bug's checks say (``major``: the peer's protocol major; ``found``:
    the word for a failure, "present" for a bug the kit found)."""
    design = dict(bug.by_design).get(major)
    if design:
        shown = results.get(design, {}).get("outcome")
        if shown == "pass":
            return f"present by design ({design} pass)"
        return f"absent ({design} fails)" if shown == "fail" else f"not run ({design}: {shown or 'no result'})"
    if not bug.checks:
        return "hunt only" if bug.strategies else "not covered"
    mine = [results[c] for c in bug.checks if c in results]
    if not mine:
        return "not run"
    failed = [r for r in mine if r["outcome"] == "fail"]
    refused = [(r, where) for r in failed if bug.refused_at and (where := _assertion(r)).startswith(bug.refused_at)]
    if refused and len(refused) == len(failed):
        r, where = refused[0]
        return f"absent: the server stops at its own check ({r['id']} dies at {where})"
    if failed:
        r = failed[0]
        death = r.get("server_death") or {}
        if death.get("sanitizer"):
            how = death["sanitizer"]["symptom"]
        elif death:
            how = death.get("status", "death").rsplit(" ", 1)[-1]
        elif _sanitizer_failure(r):
            how = r["message"].split("sanitizer reported ", 1)[1][:100]
        else:
            how = "fails: " + _evidence(r["message"])
        mark = " (verified)" if verified.get(r["id"]) else ""
        more = f" +{len(failed) - 1}" if len(failed) > 1 else ""
        return f"**{found}**: {how} ({r['id']}{more}){mark}"
    if all(r["outcome"] == "unsupported" for r in mine):
        return "n/a"
    if all(r["outcome"] in ("pass", "unsupported") for r in mine):
        return "fixed (" + ", ".join(r["id"] for r in mine if r["outcome"] == "pass") + " pass)"
    return "inconclusive (" + ", ".join(f"{r['id']} {r['outcome']}" for r in mine) + ")"


def render(records: list[dict[str, Any]], run_dir: Path, meta: dict[str, Any],
           hunts: list[dict[str, Any]] | None = None) -> str:
    """``SECURITY.md``: the class table, one column per peer, and the hunts' classes."""
    columns = []
    for rec in records:
        report = json.loads((run_dir / rec["report"]).read_text())
        columns.append((rec, {r["id"]: r for r in report["results"]}))
    tree = _TREE[meta.get("dirty")]
    lines = [TITLE, "",
             "Generated by `ggml-rpc upstream security --markdown SECURITY.md`; do not edit by hand.", "",
             f"- date: {meta['date']}", f"- commit: {meta['commit']} ({tree})", f"- machine: {meta['machine']}",
             *[f"- {rec['peer']} measured at commit {m.get('commit')} ({_TREE[m.get('dirty')]}), {m.get('date')}"
               for rec, _ in columns if (m := rec.get("measured")) and m.get("commit") != meta["commit"]],
             f"- raw results: `{run_dir.as_posix()}/` (one check report per peer; the reproducers verified against "
             "a fresh server of the same build are in `fixtures/repro/security/`)", "",
             *[f"- {rec['peer']}: a server started by `--spawn` ({_cell(rec['target'][:300])})"
               for rec, _ in columns if rec.get("target") and "/upstream/" not in rec["target"]], "",
             "A report is **rediscovered** on a build when one of its checks fails there (a death names its signal, "
             "an instrumented build the sanitizer's class), **fixed** when its checks pass, **n/a** when they do "
             "not apply to the version. `+asan-ubsan` columns are the same release built with AddressSanitizer "
             "and UBSan (`ggml-rpc upstream install --sanitize address`).", "",
             "| class | report | what | checks · strategies | " + " | ".join(r["peer"] for r, _ in columns) + " |",
             "|---|---|---|---|" + "---|" * len(columns)]
    for bug in KNOWN_BUGS:
        covered = " · ".join(part for part in (", ".join(bug.checks), ", ".join(bug.strategies)) if part)
        if bug.also:
            covered += f"; {bug.also}"
        cells = [judge(bug, results, rec["verified"], int(rec["version"].split(".")[0])) for rec, results in columns]
        lines.append(f"| {bug.key} {CLASSES[bug.cls]} | {_cell(bug.reports)} | {_cell(bug.what)} | "
                     f"{_cell(covered or '—')} | " + " | ".join(_cell(c) for c in cells) + " |")
    lines += _new_section(columns, hunts or [])
    for hunt in hunts or []:
        lines += ["", f"## `ggml-rpc fuzz --hunt` against {hunt['peer']}", "",
                  f"{hunt['seconds']:.0f} s, {hunt['examples']} examples, {hunt['messages']} messages, "
                  f"{len(hunt['classes'])} classes (SARIF rules), "
                  f"{sum(1 for c in hunt['classes'] if c['verified'])} verified on a fresh server; raw: "
                  f"`{hunt['file']}`. *explained by*: the report (or kit-found bug) whose flaw the class's failing "
                  "request carries (`explained_by`), **new** when none.", "",
                  "| class | kind | command | symptom | verified | explained by |", "|---|---|---|---|---|---|"]
        for c in hunt["classes"]:
            bug = explained_by(c)
            lines.append(f"| {_cell(c['class'])} | {c['kind']} | {c['command'] or '—'} | {_cell(c['symptom'])} | "
                         f"{'yes' if c['verified'] else 'no'} | {bug.key if bug else '**new**'} |")
    return "\n".join(lines) + "\n"


def _new_section(columns: list[tuple[dict[str, Any], dict[str, dict[str, Any]]]],
                 hunts: list[dict[str, Any]]) -> list[str]:
    """What no report names: the bugs the kit found (each measured on every build), the shadow-memory checks on
    every build, and each hunt's verified classes that no report explains."""
    peers = " | ".join(rec["peer"] for rec, _ in columns)
    lines = ["", "## Found by the kit: what no report names", "",
             "Bugs the kit found that no upstream report names yet, each stated in protocol terms, measured on every "
             "build as the reports are (**present**: one of its checks fails there), with reproducers that replay "
             "clean against the reference server.", "",
             "| bug | statement | checks · strategies | reproducers | " + peers + " |",
             "|---|---|---|---|" + "---|" * len(columns)]
    for bug in NEW_BUGS:
        covered = " · ".join(part for part in (", ".join(bug.checks), ", ".join(bug.strategies)) if part)
        cells = [judge(bug, results, rec["verified"], int(rec["version"].split(".")[0]), found="present")
                 for rec, results in columns]
        lines.append(f"| {bug.key} | {_cell(bug.what)} | {_cell(covered)} | "
                     + ", ".join(f"`{r}`" for r in bug.reproducers) + " | " + " | ".join(_cell(c) for c in cells)
                     + " |")
    lines += ["", "### The shadow-memory checks on every build", "",
              "Each SHADOW check writes through one command into one class of tensor geometries between "
              "canary-filled sentinel buffers and reads every buffer of the session back: a byte that differs from "
              "what the reference's model of the session holds fails it (**fails**), naming the buffer and the "
              "bytes. A death at an assertion (file:line) is upstream's own check stopping the whole process on a "
              "request the reference refuses by closing the connection: no corruption, but any client takes the "
              "server down with it.", "",
              "| check | what | " + peers + " |", "|---|---|" + "---|" * len(columns)]
    for case in SHADOW_CHECKS:
        cells = [_shadow_cell(results.get(case.id)) for _, results in columns]
        lines.append(f"| {case.id} | {_cell(by_id(case.id).title)} | " + " | ".join(cells) + " |")
    for hunt in hunts:
        new = [c for c in hunt["classes"] if c["verified"] and explained_by(c) is None]
        lines += ["", f"### Verified classes of the hunt against {hunt['peer']} that no report explains", ""]
        if not new:
            lines.append(f"None of its {sum(1 for c in hunt['classes'] if c['verified'])} verified classes.")
            continue
        lines += ["| class | statement | reproducer |", "|---|---|---|"]
        for c in new:
            where = f"`{c['kept']}`" if c.get("kept") else f"not kept: {c.get('not_kept', 'no reproducer')}"
            lines.append(f"| {_cell(c['class'])} | {_cell(statement(c))} | {_cell(where)} |")
    return lines


def statement(found: dict[str, Any]) -> str:
    """A hunt class in protocol terms: the request that failed, its flaw, and what the server did."""
    request = f"a {found['command']}" if found.get("command") else "a request"
    flaw = found.get("broken") or ""
    kind_of_flaw, _, detail = flaw.partition(":")
    if not flaw or found.get("rule") == "valid":
        what = f"{request} the reference accepts"
    elif kind_of_flaw == "early-close":
        what = f"{request} whose client closes {detail.strip() or 'early'}"
    else:
        what = f"{request} with a {kind_of_flaw} flaw ({detail.strip()})"
    kind = found.get("kind")
    if kind == "crash":
        return f"{what} kills the server ({found.get('symptom') or 'death'})"
    if kind == "corruption":
        return f"{what} writes outside what it names: {found.get('message', '')[:300]}"
    if kind == "info-leak":
        return f"{what} returns bytes it never wrote ({found.get('symptom') or 'leak'})"
    return f"{what}: {kind} ({found.get('message', '')[:200]})"


#: An assertion's place in a server's last log lines (``ggml-rpc.cpp:1416: GGML_ASSERT(...)``): file and line.
_ASSERTION = re.compile(r"[\w.+-]+\.(?:cpp|c|h):\d+(?=: GGML_ASSERT)")


def _assertion(result: dict[str, Any]) -> str:
    """``file:line`` of the assertion a check's server died at (its last log lines), or ''."""
    tail = (result.get("server_death") or {}).get("log_tail") or []
    return next((m.group(0) for line in reversed(tail) if (m := _ASSERTION.search(line))), "")


def _shadow_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not run"
    outcome = r["outcome"]
    if outcome == "unsupported":
        return "n/a"
    death = r.get("server_death") or {}
    if death:
        # Where an assertion stopped it (upstream's own check, a loud refusal) or nothing: a crash.
        where = _assertion(r)
        return f"**dies**: {_cell(death.get('status', 'death'))}" + (f" at {_cell(where)}" if where else "")
    if outcome == "fail":
        return f"**fails**: {_cell(_evidence(r.get('message', '')))}"
    return outcome


#: Characters of a failure's message a cell shows.
_EVIDENCE_CHARS = 200


def _evidence(message: str) -> str:
    """What a failing cell shows of a check's message: the shadow oracle's evidence (which buffer changed, where)
    rather than the write's geometry that precedes it, whole when it fits, else cut with an ellipsis."""
    at = message.find("buffer #")
    text = message[at:] if at >= 0 else message
    return text if len(text) <= _EVIDENCE_CHARS else text[:_EVIDENCE_CHARS - 1].rstrip() + "…"


_TREE = {True: "with uncommitted changes", False: "clean tree", None: "tree state unknown"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def load_hunt(path: Path, peer: str) -> dict[str, Any]:
    """A hunt's ``findings.json`` as the table's section reads it."""
    data = json.loads(path.read_text())
    return {"peer": peer, "file": path.as_posix(), "seconds": data.get("seconds", 0.0),
            "examples": data.get("examples", 0), "messages": data.get("messages", 0),
            "classes": data.get("classes", [])}


__all__ = ["MAX_KEPT_REPRODUCER", "TITLE", "judge", "keep_hunt_reproducers", "keep_reproducers", "load_hunt",
           "measure_command", "measure_peer", "render", "statement", "user_command"]
