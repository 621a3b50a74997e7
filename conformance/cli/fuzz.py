"""``ggml-rpc fuzz``: stateful, model-based fuzzing of a ggml RPC server, with shrunk reproducers."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..harness import ExternalTarget, SpawnedTarget, Target, TargetError, parse_address
from .console import ready_kernels
from .interrupts import soft_stop
from .options import STDOUT, UsageError, output_dir, output_file, proto_help

DEFAULT_OUT = "fuzz-findings"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Sends valid and near-valid requests (one rule broken) of every command, drawn by a hypothesis "
        "state machine, to the server and to an in-process model (the reference server's own connection logic), "
        "and reports crashes, hangs, wrong replies and out-of-buffer data. Each finding is shrunk and saved as a "
        "pcap that `ggml-rpc replay` re-runs, plus a one-line summary. Exit code 1 when anything was found."
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="HOST:PORT", help="fuzz a running server (default: the embedded "
                       "reference server)")
    where.add_argument("--spawn", metavar="CMD", help="start the server with this command line ({port} is replaced "
                       "by a free port) and restart it after every crash")
    p.add_argument("--proto", default="auto", help=proto_help("auto", auto="from the server's HELLO; 7 for the "
                                                             "embedded server"))
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--examples", type=int, default=None, metavar="N", help="stop after N examples")
    budget.add_argument("--seconds", type=float, default=None, metavar="SECONDS", help="the campaign takes SECONDS "
                        "(the target's and the model's setup, examples and shrinking; the warm-up of the kit's own "
                        "compiled kernels and writing the reports come on top; default: 60 when no budget is given)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="campaign seed: the same seed draws the same "
                   "examples (default 0)")
    p.add_argument("-o", "--output", "--out", dest="out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"where findings are saved (default {DEFAULT_OUT}/; --out: the older spelling, kept as an "
                   "alias)")
    p.add_argument("--no-fork-server", dest="fork_server", action="store_false", help="with --spawn: start the "
                   "server anew after every death instead of forking it (by default the kit's fork server is "
                   "preloaded into the server: started once, each restart a fork of it as it first accepted a "
                   "connection, when the server allows it)")
    p.add_argument("--wait-restart", type=float, default=0.0, metavar="SECONDS", help="when the target dies and was "
                   "not spawned here, wait up to SECONDS for it to come back instead of stopping (default 0)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="how long without a reply or a "
                   "close makes a hang (default 5)")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="state machine steps per example (each a "
                   "request and a seeded burst of up to 48 more; default 60)")
    p.add_argument("--hunt", action="store_true", help="campaign mode for a target that dies often (upstream "
                   "rpc-server): seeded examples with strategies aimed at its known crash and leak classes, going "
                   "on after every death; one shrunk, re-verified reproducer per finding class")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="run N fuzzing processes (seeds SEED "
                   "to SEED+N-1, each with its own target when the target is spawned or embedded; budgets are per "
                   "worker) sharing one findings set and corpus through --database; their reports are merged into "
                   "--output, each finding class once, the workers' own in --output/worker-K")
    p.add_argument("--database", metavar="DIR|redis://HOST:PORT/DB", default=None, help="the hypothesis example "
                   "database the workers share: a folder (default --output/database) or a Redis server that workers "
                   "on several machines reach (needs the redis package: pip install 'ggml-rpc-kit[redis]'); a "
                   "class any worker found is not shrunk or saved again by another, and the merged report holds the "
                   "classes of every machine")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a worker process's label (set by --workers)
    p.add_argument("--no-shadow", dest="shadow", action="store_false", help="do not apply the shadow-memory "
                   "oracle (by default, after every write the buffers it must not have touched are read back and "
                   "judged: a difference is a corruption finding)")
    p.add_argument("--html", metavar="DIR", help="write DIR/index.html: one row per finding class, a page per class "
                   "with its reproducer's messages decoded by the spec")
    p.add_argument("--sarif", metavar="FILE|-", help="also write the findings as SARIF 2.1.0 (one result per "
                   "finding class, the reproducer as its artifact; '-': standard output, the summary then goes to "
                   "standard error); findings.json goes to --output when anything was found, with --hunt, or with "
                   "--sarif")
    p.set_defaults(func=run)


class Status:
    """The live status line (rewritten in place on a terminal, one line every few seconds otherwise)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last = 0.0

    def update(self, campaign) -> None:
        now = time.monotonic()
        if not self.tty and now - self._last < 5.0:
            return
        self._last = now
        st = campaign.stats
        line = (f"{st.examples} examples, {st.messages} messages ({st.broken} near-valid), {st.rate:,.0f} execs/s, "
                f"{len(campaign.findings)} finding(s), {st.seconds:.0f} s, RSS {st.max_rss_kib // 1024} MiB"
                + (f" + target {st.max_target_rss_kib // 1024} MiB" if st.max_target_rss_kib else ""))
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finding(self, saved) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"FINDING {saved.line()}\n")
        if saved.pcap is not None:
            self.stream.write(f"  reproducer: {saved.pcap}\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _target(args: argparse.Namespace) -> Target:

    if args.spawn:
        if "{port}" not in args.spawn:
            raise UsageError("--spawn needs a {port} placeholder in CMD (the fuzzer picks a free port)")
        from ..fuzz.targets import spawned_target

        # An upstream server started with -c gets a cache directory the fuzzer owns, so the model can follow it.
        return spawned_target(args.spawn, fork_server=args.fork_server)
    try:
        host, port = parse_address(args.server)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return ExternalTarget(host, port)


def _worker_argv(args: argparse.Namespace, number: int, label: str, out: Path, database: str) -> list[str]:
    """The command line of worker ``number``: this run's options, its own seed and output folder."""
    argv = ["fuzz", "--proto", args.proto, "--seed", str(args.seed + number), "-o", str(out), "--timeout",
            str(args.timeout), "--wait-restart", str(args.wait_restart), "--worker", label, "--database", database]
    for option, value in (("--server", args.server), ("--spawn", args.spawn), ("--examples", args.examples),
                          ("--seconds", args.seconds), ("--steps", args.steps)):
        if value is not None:
            argv += [option, str(value)]
    return argv + (["--hunt"] if args.hunt else []) + ([] if args.fork_server else ["--no-fork-server"])


def run_workers(args: argparse.Namespace) -> int:
    """``--workers N``: N worker processes of this campaign, then their reports merged into one."""
    import socket
    import subprocess

    from ..fuzz.workers import DatabaseError, SharedFindings, merge_reports, open_database, sarif_of_record

    out = Path(args.out)
    database = args.database or str(out / "database")
    try:
        db = open_database(database)
    except DatabaseError as exc:
        raise UsageError(str(exc)) from None
    host = socket.gethostname()
    folders = [(f"{host}/{k}", out / f"worker-{k}") for k in range(args.workers)]
    print(f"{args.workers} worker(s), findings shared through {database}", file=sys.stderr)
    procs = []
    try:
        for k, (label, folder) in enumerate(folders):
            folder.mkdir(parents=True, exist_ok=True)
            log = open(folder / "worker.log", "w")  # closed once the worker has ended (below)
            argv = [sys.executable, "-m", "ggml_rpc.conformance.cli", *_worker_argv(args, k, label, folder,
                                                                                      database)]
            procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
        for proc, log in procs:
            proc.wait()
            log.close()
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
            log.close()
    key = _campaign_key_of(folders)
    shared = SharedFindings(db, key, host) if key is not None else None
    record = merge_reports(folders, out, shared)
    if args.sarif:
        text = json.dumps(sarif_of_record(record), indent=2) + "\n"
        if args.sarif == STDOUT:
            sys.stdout.write(text)
        else:
            Path(args.sarif).parent.mkdir(parents=True, exist_ok=True)
            Path(args.sarif).write_text(text)
    summary = sys.stderr if args.sarif == STDOUT else sys.stdout  # stdout stays the SARIF log alone
    failed = [label for (label, _), (proc, _) in zip(folders, procs, strict=True) if proc.returncode not in (0, 1)]
    print(f"{len(folders)} worker(s): {record['examples']} examples, {record['messages']} messages in "
          f"{record['seconds']:.1f} s: {record['messages_per_second']:,.0f} execs/s; target restarts "
          f"{record['restarts']}; {len(record['classes'])} finding class(es), each once", file=summary)
    for c in record["classes"]:
        print(f"  {c['kind']} on {c.get('command') or '-'} ({c['class']}; worker {c['worker']}, {c.get('hits', 1)} "
              f"hit(s)): {c.get('reproducer') or 'no reproducer here'}", file=summary)
    if failed:
        print(f"worker(s) that failed: {', '.join(failed)} (see their worker.log)", file=sys.stderr)
        return 2
    return 1 if record["classes"] else 0


def _campaign_key_of(folders: list[tuple[str, Path]]) -> bytes | None:
    """The campaign key the workers used (each wrote it into its findings.json)."""
    for _, folder in folders:
        try:
            data = json.loads((folder / "findings.json").read_text())
        except (OSError, ValueError):
            continue
        if data.get("shared_key"):
            return str(data["shared_key"]).encode()
    return None


def run(args: argparse.Namespace) -> int:
    from ggml_rpc.spec import V7, parse_version_option

    from ..fuzz import Options, embedded_campaign, target_campaign
    from ..fuzz.hunt import HUNT_STEPS, embedded_hunt, hunt_campaign, write_reports
    from ..fuzz.setup import SetupError

    # Every output is checked before any work (a worker's too).
    if args.sarif:
        output_file(args.sarif, "--sarif")
    for option, folder in (("--html", args.html), ("--output", args.out)):
        if folder:
            output_dir(folder, option)
    if args.workers is not None and args.workers < 1:
        raise UsageError("--workers must be at least 1")
    if args.worker is None and (args.workers is not None or args.database is not None):
        if args.html:
            raise UsageError("--html with --workers/--database: run `ggml-rpc fuzz` once per worker for pages")
        args.workers = args.workers or 1
        return run_workers(args)

    # The budget counts from here: setup (target, model), examples, shrinking, reports; not the interpreter's
    # imports before this line nor the kit's kernel warm-up below.
    started = time.monotonic()

    if args.examples is not None and args.examples < 1:
        raise UsageError("--examples must be at least 1")
    if args.seconds is not None and args.seconds <= 0:
        raise UsageError("--seconds must be positive")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    # With the SARIF log on standard output, the summary moves to standard error: stdout stays one document.
    summary_out = sys.stderr if args.sarif == STDOUT else sys.stdout
    try:
        protocol = None if args.proto == "auto" else parse_version_option(args.proto)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    seconds = args.seconds if args.seconds is not None or args.examples is not None else 60.0
    options = Options(examples=args.examples, seconds=seconds, seed=args.seed, out_dir=Path(args.out),
                      timeout=args.timeout, wait_restart=args.wait_restart, shadow=args.shadow)
    if seconds is not None:
        # Shrinking a finding takes at most half the budget (a minute at most): short runs stay short.
        options.shrink_seconds = min(options.shrink_seconds, max(5.0, seconds / 2))
    if args.hunt:
        options.steps = HUNT_STEPS
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError("--steps must be at least 1")
        options.steps = args.steps
    # The model that judges every reply computes with the compiled kernels, and so does the embedded target (a fork
    # of this process): ready before the first example, so that no reply is judged late for a compile.
    warming = time.monotonic()
    ready_kernels()
    if seconds is not None:
        # The kit's own warm-up (loading its kernels, or compiling them on a first run) is not the campaign's.
        options.deadline = started + (time.monotonic() - warming) + seconds
    status = Status()
    hooks = {"progress": status.update, "on_finding": status.finding}
    if args.hunt:
        # The same two calls, in the mode for a target that dies often.
        embedded_campaign, target_campaign = embedded_hunt, hunt_campaign
    if args.server is None and args.spawn is None:
        campaign = embedded_campaign(protocol or V7, options, **hooks)
    else:
        target = _target(args)
        try:
            target.start()
        except TargetError as exc:
            raise UsageError(str(exc)) from None
        try:
            campaign = target_campaign(target, options, protocol=protocol, **hooks)
        except SetupError as exc:
            target.stop()
            raise UsageError(str(exc)) from None
    target = campaign.target
    shared_key = None
    if args.worker is not None:
        from ..fuzz.workers import DatabaseError, SharedFindings, campaign_key, open_database

        # The campaign's identity: the server as the user named it and the protocol it speaks (not a worker's
        # port or cache folder).
        shared_key = campaign_key(args.spawn or args.server or target.description, campaign.protocol.label)
        try:
            campaign.store.shared = SharedFindings(open_database(args.database), shared_key, args.worker)
        except DatabaseError as exc:
            target.stop()
            raise UsageError(str(exc)) from None

    def stop() -> None:
        # First signal: finish cleanly (summary, target stopped); a second one ends at once.  From here on a dead
        # target is the kit's own doing (the group's signal reached it too): the campaign saves no finding.
        print("\ninterrupted: stopping after the current example (Ctrl-C again to abort)", file=sys.stderr)
        campaign.request_stop()

    try:
        with soft_stop(stop):
            if args.server is None and args.spawn is None:
                target.start()
            where = "" if target.address in target.description else f" at {target.address}"
            print(f"fuzzing {target.description}{where}, protocol {campaign.protocol.label}, seed "
                  f"{args.seed}", file=sys.stderr)
            if isinstance(target, SpawnedTarget):
                print(target.restart_mode, file=sys.stderr)
            campaign.run()
    finally:
        target.stop()
        status.done()
    print_summary(campaign, summary_out)
    # A clean run without these leaves nothing; a worker always reports (to be merged).
    if campaign.findings or args.hunt or args.sarif or args.html or args.worker:
        path = write_reports(campaign, Path(args.out), args.sarif)
        if shared_key is not None:
            data = json.loads(path.read_text())
            data["shared_key"] = shared_key.decode()
            path.write_text(json.dumps(data, indent=2) + "\n")
        if args.html:
            from ..fuzz.html import write_findings_html

            index = write_findings_html(json.loads(path.read_text()), args.html)
            print(f"HTML report: {index}", file=sys.stderr)
    return 1 if campaign.findings else 0


def _forks(target: Target) -> str:
    forks = getattr(target, "fork_restarts", 0)
    return f" ({forks} of them forks)" if forks else ""


def print_summary(campaign, out=None) -> None:
    out = out or sys.stdout
    st = campaign.stats
    from ..fuzz.findings import KINDS

    kinds = {k: 0 for k in KINDS}
    for f in campaign.findings:
        kinds[f.kind] += 1
    out.write(f"{st.examples} examples, {st.messages} messages ({st.broken} near-valid) in {st.seconds:.1f} s: "
              f"{st.rate:,.0f} execs/s; max RSS {st.max_rss_kib / 1024:.0f} MiB (fuzzer and model)"
              + (f", {st.max_target_rss_kib / 1024:.0f} MiB (target)" if st.max_target_rss_kib else "")
              + f"; target restarts {st.restarts}" + _forks(campaign.target)
              + (f"; shadow-memory reads {st.shadow_reads}" if st.shadow_reads else "") + "\n")
    if st.by_flaw:
        out.write("rules broken: " + ", ".join(f"{k} {v}" for k, v in sorted(st.by_flaw.items())) + "\n")
    out.write("findings: " + ", ".join(f"{v} {k}" for k, v in kinds.items()) + "\n")
    unverified = [f for f in campaign.findings if f.verified is False]
    if unverified:
        out.write(f"{len(unverified)} of them not verified (the reproducer did not fail a fresh target again)\n")
    for f in campaign.findings:
        out.write(f"  {f.line()}\n")
        if f.pcap is not None:
            out.write(f"    {f.pcap}  (ggml-rpc replay {f.pcap} --server HOST:PORT)\n")
    if campaign.stopped_because and campaign.stopped_because != "budget spent":
        out.write(f"stopped: {campaign.stopped_because}\n")
