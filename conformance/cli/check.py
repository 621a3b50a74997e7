"""``ggml-rpc check``: run the conformance catalogue against a live server (or the embedded reference server)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ggml_rpc.spec import V7, Protocol
from rich.console import Console

from ..harness import (
    DEFAULT_SEED,
    PROFILES,
    Category,
    EmbeddedTarget,
    ExternalTarget,
    Profile,
    Runner,
    SpawnedTarget,
    Target,
    TargetError,
    select,
)
from ..upstream.codebooks import tables
from ..upstream.known_bugs import safe_profile
from .console import PipeConsole, ready_kernels
from .options import UsageError, one_stdout, output_dir, output_file, parse_address, parse_proto, proto_help


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run the conformance checks against a live ggml RPC server. Without --server or --spawn the "
        "embedded reference server is started on an ephemeral loopback port (protocol 7 with a temporary cache "
        "directory; --proto 6 starts a protocol 6 one). The run ends with one verdict, the same in every report "
        "and the exit code: 0 conformant (every applicable MUST rule passed, nothing died, every selected check "
        "could judge the server); 1 not conformant (a MUST rule failed, the server died, a check crashed; "
        "--strict: a SHOULD rule failed); 3 not covered (the server announces a protocol version this kit does "
        "not cover); 4 incomplete (the server refused the harness's own setup, so checks were blocked); "
        "2 usage error or unreachable server; 130 interrupted."
    )
    p.add_argument("--server", metavar="HOST:PORT", help="address of the server under test")
    p.add_argument("--spawn", metavar="CMD", help="start the server under test with CMD ({port} is replaced by a "
                   "free port); it is restarted after a check kills it, and the death is reported")
    p.add_argument("--fork-server", action="store_true", help="with --spawn: preload the kit's fork server, so that "
                   "the server is started once and each restart after a death is a fork of it as it first accepted "
                   "a connection (verdicts are the same; against the 8.0.0 wheel some compute checks ran much slower "
                   "in a forked server, hence not the default)")
    p.add_argument("--proto", default="auto", help="the version expected (and, without --server/--spawn, the one "
                   "the embedded server speaks): " + proto_help("auto", auto="learn it from HELLO"))
    p.add_argument("--checks", metavar="PATTERN", help="comma-separated shell patterns on check IDs or categories "
                   "(e.g. 'HELLO-*,cache-v7')")
    p.add_argument("--profile", choices=sorted(PROFILES), help="run a profile of the catalogue instead of all of it; "
                   + "; ".join(f"{name}: {meaning}" for name, meaning in PROFILES.items())
                   + ". The verdict then reads 'conformant on the safe profile (N checks left out: a partial run, "
                   "not full conformance)', in every report")
    p.add_argument("-q", "--quiet", action="store_true", help="print the verdict line only (and, when the run "
                   "fails, each failure with its evidence)")
    p.add_argument("--strict", action="store_true", help="SHOULD failures fail the run too")
    p.add_argument("--cache-dir", metavar="DIR", help="the server's cache directory: enables white-box cache checks "
                   "and makes a missing cache a failure")
    p.add_argument("--json", metavar="FILE|-", help="write the results as JSON ('-': standard output, the text "
                   "report then goes to standard error)")
    p.add_argument("--junit", metavar="FILE|-", help="write the results as JUnit XML (the verdict is a test case "
                   "too; '-': standard output)")
    p.add_argument("--sarif", metavar="FILE|-", help="write the failed and blocked checks as SARIF 2.1.0 ('-': "
                   "standard output)")
    p.add_argument("--html", metavar="DIR", help="write a static HTML report: DIR/index.html, a page per check with "
                   "its exchange decoded by the spec, DIR/protocol.html")
    p.add_argument("--pcap-dir", metavar="DIR", help="write each failing check's exchange as DIR/<ID>.pcap (real "
                   "TCP framing; `ggml-rpc replay` re-runs it, the kit's dissector shows it)")
    p.add_argument("--pcap-all", action="store_true", help="with --pcap-dir: a pcap of every check, not only the "
                   "failing ones")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, metavar="N",
                   help=f"seed of every input a check draws (compute graphs, COMM tensors; default {DEFAULT_SEED}): "
                   "one seed, the same bytes sent; printed and stored in every report")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for an answer or a close (default 5)")
    p.add_argument("--list", action="store_true", help="print the catalogue and exit")
    p.set_defaults(func=run)


def _target(args: argparse.Namespace, proto: Protocol | None) -> Target:

    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    if cache_dir is not None and not cache_dir.is_dir() and (args.server or args.spawn):
        raise UsageError(f"--cache-dir {args.cache_dir}: not a directory")
    address = parse_address(args.server, "--server") if args.server else None
    if args.spawn:
        target = SpawnedTarget(args.spawn, cache_dir=cache_dir, fork_server=args.fork_server)
        if address is not None:
            target.host, target.port = address
        elif "{port}" not in args.spawn:
            raise UsageError("--spawn CMD needs a {port} placeholder or --server HOST:PORT")
        return target
    if address is not None:
        return ExternalTarget(*address, cache_dir=cache_dir)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    # The IQ codebooks come from an installed upstream peer, as for `serve` (the reference holds no upstream data).
    return EmbeddedTarget(proto or V7, cache_dir, codebooks=tables)


def run(args: argparse.Namespace) -> int:
    from ggml_rpc.conformance.checks import CATALOGUE

    from ..harness import report
    from ..harness.artifacts import write_html, write_pcaps
    from ..harness.report_files import write_json, write_junit, write_sarif

    # With a report on standard output the text report moves to standard error: stdout stays one document.
    to_stderr = one_stdout(json=args.json, junit=args.junit, sarif=args.sarif)
    probe = Console(stderr=to_stderr)
    # Logs and pipes get a wide table instead of rich's 80-column default (COLUMNS still wins when set).
    console = PipeConsole(highlight=False, stderr=to_stderr,
                          width=None if probe.is_terminal or "COLUMNS" in os.environ else 120)
    checks = select(CATALOGUE, args.checks)
    if not checks:
        raise UsageError(f"--checks {args.checks!r} matches no check (see --list)")
    profile = None
    if args.profile:
        chosen = safe_profile(checks)
        if not chosen:
            raise UsageError(f"--profile {args.profile} holds none of the checks --checks {args.checks!r} selects")
        profile = Profile(args.profile, PROFILES[args.profile], len(checks) - len(chosen))
        checks = chosen
    if args.list:
        console.print(report.catalogue_table(checks))
        console.print(f"{len(checks)} checks")
        return 0
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    if args.seed < 0:
        raise UsageError("--seed must be a non-negative integer")
    if args.pcap_all and not args.pcap_dir:
        raise UsageError("--pcap-all needs --pcap-dir DIR")
    # Every output is checked before the run: a report that cannot be written must not cost the run first.
    for option, folder in (("--html", args.html), ("--pcap-dir", args.pcap_dir)):
        if folder:
            output_dir(folder, option)
    for option, path in (("--json", args.json), ("--junit", args.junit), ("--sarif", args.sarif)):
        if path:
            output_file(path, option)
    proto = parse_proto(args.proto)
    target = _target(args, proto)
    # Before any server starts: the embedded one, a spawned `ggml-rpc serve` (it loads what this compiles) and the
    # checks' own reference results all use the compiled kernels; no check's timeout may run while they compile.
    ready_kernels()
    runner = Runner(target, expect=proto, timeout=args.timeout, probe_timeout=args.timeout, seed=args.seed)
    runner.profile = profile
    try:
        runner.start()
    except TargetError as exc:
        runner.stop()
        raise UsageError(str(exc)) from None
    if args.server and not args.spawn and profile is None:
        print("ggml-rpc check: warning: the suite sends malformed input and the inputs of known upstream crashes, "
              "which take real rpc-servers down; for a server someone depends on use --profile safe, or let the kit "
              "start (and restart) it with --spawn CMD", file=sys.stderr, flush=True)
    try:
        if not args.quiet:
            report.header(console, target.description, target.address, runner.info)
            console.print(f"seed {runner.seed} (--seed {runner.seed} sends the same inputs again)")
            if isinstance(target, SpawnedTarget):
                console.print(target.restart_mode)
            if profile is not None:
                console.print(f"profile {profile.name}: {len(checks)} checks, {profile.left_out} left out "
                              f"({profile.meaning})", soft_wrap=True)
        totals: dict[Category, int] = {}
        for c in checks:
            totals[c.category] = totals.get(c.category, 0) + 1
        progress = None if args.quiet else report.Progress(console, totals)
        try:
            runner.run(checks, progress.update if progress is not None else lambda _result: None)
        finally:
            if progress is not None:
                progress.close()
    finally:
        runner.stop()
    verdict = runner.verdict(args.strict)
    if not args.quiet:
        console.print(report.results_table(runner.results))
    report.failure_details(console, runner.results)
    report.setup_errors(console, runner)
    advice = report.not_run_advice(runner)
    if advice:
        console.print(f"\n{advice}", soft_wrap=True, markup=False, highlight=False)
    if args.quiet:
        console.print(report.verdict_text(verdict), soft_wrap=True)
    else:
        console.print(report.summary_line(runner, args.strict), soft_wrap=True)
    try:
        # pcaps first, then the HTML pages that link them, then the reports that name both.
        if args.pcap_dir:
            n = write_pcaps(runner.results, args.pcap_dir, every=args.pcap_all)
            if not args.quiet:
                console.print(f"{n} pcap(s) in {args.pcap_dir}")
        if args.html:
            index = write_html(runner, args.html, args.strict)
            if not args.quiet:
                console.print(f"HTML report: {index}")
        if args.json:
            write_json(runner, args.json, args.strict)
        if args.junit:
            write_junit(runner, args.junit, args.strict)
        if args.sarif:
            write_sarif(runner, args.sarif, args.strict)
    except OSError as exc:
        raise UsageError(f"cannot write the report: {exc.strerror or exc}: {exc.filename}") from None
    return verdict.exit_code
