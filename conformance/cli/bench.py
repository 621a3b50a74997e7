"""``ggml-rpc bench``: the kit's reference server and any other servers measured side by side, and the kit itself.

The reference server is started in a process of its own (``ggml-rpc serve`` on a free loopback port, with a
temporary cache directory), as any server under test runs: the client's Python work is not charged to it.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ggml_rpc.bench.kit import GraphDecode, PcapDecode, PcapWrite, Replay, SessionFiles
from ggml_rpc.bench.report import BenchProgress, figures_table, header, write_json
from ggml_rpc.bench.runner import FigureResult, Measurement, record, run_measurement, steps_of
from ggml_rpc.bench.server_figures import (
    MIB,
    BenchTarget,
    GetTensor,
    GraphCompute,
    HashHit,
    RoundTrips,
    SetTensor,
    size_label,
)
from ggml_rpc.spec import HandshakeError, ProtocolError, parse_version_option
from rich.console import Console

from ..client import ConnectionClosed
from ..harness import SpawnedTarget, TargetError, parse_address
from .console import PipeConsole, ready_kernels
from .options import UsageError, proto_help

KIB = 1 << 10

# The project's own objectives for the reference server and the kit (see BENCHMARKS.md for where each comes from).
GOAL_BULK = (">=", 1200.0, "BENCHMARKS.md: reference server")
GOAL_ROUND_TRIPS = (">=", 20000.0, "BENCHMARKS.md: reference server")
GOAL_DECODE = (">=", 500.0, "BENCHMARKS.md: decoding")
GOAL_REPLAY = (">=", 300.0, "BENCHMARKS.md: sessions")
GOAL_PCAP_WRITE = (">=", 200.0, "BENCHMARKS.md: sessions")
GOAL_GRAPH_DECODE = ("<=", 10.0, "BENCHMARKS.md: decoding")
#: The reference server's bulk transfers must reach this fraction of another server's (a C++ one) in the same run.
BULK_RATIO_GOAL = 0.8


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of one run."""

    repeat: int
    transfers: tuple[tuple[int, int], ...]  # (size, transfers per sample)
    round_trips: int
    graph_tensors: int
    hash_size: int
    session_bytes: int
    session_chunk: int


FULL = Plan(repeat=7, transfers=((4 * KIB, 256), (MIB, 32), (256 * MIB, 1)), round_trips=2000,
            graph_tensors=10_000, hash_size=16 * MIB, session_bytes=1 << 30, session_chunk=MIB)
# A few seconds in all: small sizes, few repetitions (for tests and a first look).
QUICK = Plan(repeat=3, transfers=((4 * KIB, 32), (MIB, 4), (16 * MIB, 1)), round_trips=200,
             graph_tensors=1_000, hash_size=16 * MIB, session_bytes=8 * MIB, session_chunk=256 * KIB)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure, on loopback, SET_TENSOR/GET_TENSOR throughput (4 KiB, 1 MiB, 256 MiB), small round "
        "trips per second, a 10,000-tensor GRAPH_COMPUTE end to end, SET_TENSOR_HASH hit latency and session replay "
        "for the reference server (started in its own process) and every --server, samples interleaved so that "
        "machine drift cancels; then the kit's pcap writing and decoding. Prints medians, spread and the ratio to "
        "the first target. Exit code 0: every figure taken; 1: a server failed or answered wrongly on some figure; "
        "2: usage error or unreachable server."
    )
    p.add_argument("--server", action="append", default=[], metavar="[NAME=]HOST:PORT",
                   help="another server to measure (repeatable), e.g. cpp=127.0.0.1:50052 for upstream rpc-server")
    p.add_argument("--no-reference", action="store_true",
                   help="do not start the reference server (the first --server becomes the baseline)")
    p.add_argument("--proto", default="7", help="protocol of the reference server: " + proto_help("7"))
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions: a few seconds in all")
    p.add_argument("--repeat", type=int, metavar="N", help="timed samples per figure and target (default 7, "
                   "--quick 3)")
    p.add_argument("--capture", type=Path, metavar="PCAP", help="decode and replay this capture instead of the "
                   "generated session (e.g. a real one)")
    p.add_argument("--no-kit", action="store_true", help="skip the kit figures (pcap writing, decode, replay)")
    p.add_argument("--json", metavar="FILE|-", help="write every sample and statistic as JSON ('-': standard "
                   "output)")
    p.add_argument("--no-upstream", action="store_true", help="without --server, do not add the installed upstream "
                   "rpc-server of the same version (`ggml-rpc upstream install`) as the server compared with")
    p.add_argument("--generation", type=int, default=None, metavar="ROUNDS",
                   help="rounds of the generation figure (tokens/s of upstream llama-completion through the "
                   "reference server and through upstream rpc-server; default 3 when upstream is installed, 0 with "
                   "--quick; 0 skips it)")
    p.set_defaults(func=run)


def _servers(specs: Sequence[str]) -> list[BenchTarget]:
    out: list[BenchTarget] = []
    for spec in specs:
        name, sep, addr = spec.rpartition("=")
        try:
            host, port = parse_address(addr)
        except ValueError as exc:
            raise UsageError(f"--server: {exc}") from None
        target = BenchTarget(name if sep else "", host, port, description="external server")
        target.name = name if sep and name else target.address
        out.append(target)
    names = [t.name for t in out] + ["reference", "kit"]
    if len(set(names)) != len(names):
        raise UsageError("--server: every server needs its own name and address (reference and kit are taken)")
    addresses = [(t.host, t.port) for t in out]
    if len(set(addresses)) != len(addresses):
        raise UsageError("--server: the same address twice (a server serves one connection at a time)")
    return out


def _upstream_peer(proto: str) -> object | None:
    """The installed upstream peer of the reference server's major version, or None."""
    from ..upstream.peers import PEERS

    major = parse_version_option(proto).major
    for peer in PEERS.values():
        if peer.major == major and peer.installed():
            return peer
    return None


@contextlib.contextmanager
def _upstream(peer: object) -> Iterator[BenchTarget]:
    """Upstream ``rpc-server -c`` of ``peer`` on loopback with a temporary ``LLAMA_CACHE``."""
    from ..upstream.runs import UpstreamServer

    try:
        server = UpstreamServer(peer, cache=True).__enter__()  # type: ignore[arg-type]
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    try:
        yield BenchTarget("upstream", "127.0.0.1", server.port,
                          description=f"upstream rpc-server {peer.version} -c (installed peer)")  # type: ignore[attr-defined]
    finally:
        server.__exit__(None, None, None)


@contextlib.contextmanager
def _reference(proto: str) -> Iterator[BenchTarget]:
    """The reference server in its own process, with a temporary cache directory."""
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-bench-cache-") as cache:
        # Through the entry function, as the console script runs it (``python -m`` would load the CLI module twice).
        entry = "import sys; from ggml_rpc.conformance.cli import main; sys.exit(main())"
        command = (f"{shlex.quote(sys.executable)} -c {shlex.quote(entry)} serve --host 127.0.0.1 "
                   f"--port {{port}} --proto {shlex.quote(proto)} --cache-dir {shlex.quote(cache)}")
        spawned = SpawnedTarget(command, cache_dir=Path(cache))
        try:
            spawned.start()
        except TargetError as exc:
            raise UsageError(f"cannot start the reference server: {exc}") from None
        try:
            yield BenchTarget("reference", spawned.host, spawned.port,
                              description=f"reference server, protocol {proto}, own process, temporary cache",
                              cache_dir=cache)
        finally:
            spawned.stop()


def _probe(target: BenchTarget) -> None:
    """HELLO: the version decides every later layout (an uncovered or unreachable server is a usage error)."""
    try:
        target.connect(timeout=10.0).close()
    except HandshakeError as exc:
        raise UsageError(f"{target.name}: {exc}") from None
    except (OSError, ProtocolError, ConnectionClosed) as exc:
        raise UsageError(f"{target.name} ({target.address}): cannot talk to the server: {exc}") from None


def _server_measurements(plan: Plan) -> list[Measurement]:
    out: list[Measurement] = []
    for size, batch in plan.transfers:
        out.append(SetTensor(size, batch, GOAL_BULK if size == 256 * MIB else None))
    for size, batch in plan.transfers:
        out.append(GetTensor(size, batch, GOAL_BULK if size == 256 * MIB else None))
    out.append(RoundTrips(plan.round_trips, 1, GOAL_ROUND_TRIPS))
    out.append(RoundTrips(plan.round_trips, 2))
    out.append(GraphCompute(plan.graph_tensors))
    out.append(HashHit(plan.hash_size))
    return out


def run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    repeat = args.repeat if args.repeat is not None else plan.repeat
    if repeat < 1:
        raise UsageError("--repeat must be at least 1")
    try:
        parse_version_option(args.proto)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    externals = _servers(args.server)
    if args.no_reference and not externals:
        raise UsageError("--no-reference needs at least one --server")
    if args.capture is not None and not args.capture.is_file():
        raise UsageError(f"--capture {args.capture}: no such file")
    # With the JSON on standard output the tables go to standard error, so stdout stays one document.
    console = PipeConsole(highlight=False, stderr=args.json == "-")
    if not console.is_terminal:  # logs and pipes: wide enough that every row of the table stays on one line
        console.width = max(console.width, 160)
    started = time.time()
    t0 = time.perf_counter()
    peer = None if args.no_reference else _upstream_peer(args.proto)
    rounds = args.generation if args.generation is not None else (0 if args.quick or peer is None else 3)
    if rounds < 0:
        raise UsageError("--generation must be 0 or more")
    if rounds and peer is None:
        raise UsageError("--generation needs an installed upstream peer of the same version: run "
                         "`ggml-rpc upstream install`")
    if not args.no_reference:
        # The reference measured is a `ggml-rpc serve` process: it loads what this compiles, and no figure (nor its
        # start-up wait) includes the kit's own compile.
        ready_kernels()
    with contextlib.ExitStack() as stack:
        targets = [] if args.no_reference else [stack.enter_context(_reference(args.proto))]
        targets += externals
        if not externals and peer is not None and not args.no_upstream:
            targets.append(stack.enter_context(_upstream(peer)))
        for t in targets:
            _probe(t)
        header(console, targets, plan_text(plan, repeat, args))
        measurements = _server_measurements(plan)
        kit: list[Measurement] = []
        if not args.no_kit:
            replay, kit = _kit_measurements(args, plan, targets[0], console, stack)
            measurements.append(replay)
        names = [t.name for t in targets]
        total = sum(steps_of(repeat, len(targets)) for _ in measurements) + sum(steps_of(repeat, 1) for _ in kit)
        server_results: list[FigureResult] = []
        kit_results: list[FigureResult] = []
        with BenchProgress(console, total) as progress:
            for m in measurements:
                server_results.append(run_measurement(m, targets, names, repeat, progress.update))
            for m in kit:
                kit_results.append(run_measurement(m, [None], ["kit"], repeat, progress.update))
        seconds = time.perf_counter() - t0
        comparisons = bulk_comparisons(server_results, names, plan)
        failed = _print_results(console, server_results, kit_results, names, comparisons)
        console.print(f"{len(server_results) + len(kit_results)} figures, {repeat} samples each, "
                      f"{seconds:.1f} s", style="dim")
        generation = _generation(console, peer, rounds) if rounds else []
        if args.json:
            doc = record([t.as_dict() for t in targets], server_results, kit_results, quick=args.quick,
                         repeat=repeat, started=started, seconds=seconds, command=command_line(args),
                         bulk_comparisons=comparisons)
            doc["generation"] = [g.as_dict() for g in generation]
            try:
                write_json(args.json, doc)
            except OSError as exc:
                raise UsageError(f"cannot write {args.json}: {exc.strerror or exc}") from None
    return 1 if failed else 0


#: Generation goals (reference / upstream tokens/s), per bench model.
GENERATION_GOALS = {"bench-f32": 0.5, "bench-q8_0": 0.3}


def _generation(console: Console, peer: object, rounds: int) -> list:
    """The generation figure: llama-completion through each server, interleaved rounds, and the ratio."""
    from rich.table import Table

    from ..upstream.generation import GenerationError, measure

    with console.status("generation: upstream llama-completion through the reference and upstream servers"):
        try:
            results = measure(peer, tuple(GENERATION_GOALS), rounds=rounds)  # type: ignore[arg-type]
        except GenerationError as exc:
            console.print(f"[red]error[/red] generation: {exc}")
            return []
    table = Table(title=f"Generation (upstream llama-completion {peer.version}, 64 tokens, "  # type: ignore[attr-defined]
                  f"{rounds} interleaved rounds)")
    for col in ("model", "reference tokens/s", "upstream tokens/s", "ratio", "goal"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for g in results:
        goal = GENERATION_GOALS[g.model]
        met = "met" if g.ratio >= goal else "not met"
        table.add_row(g.model, f"{g.reference.median:,.0f}", f"{g.upstream.median:,.0f}", f"{g.ratio:.2f}x",
                      f">= {goal}x {met}")
    console.print(table)
    return results


def _kit_measurements(
    args: argparse.Namespace, plan: Plan, first: BenchTarget, console: Console, stack: contextlib.ExitStack
) -> tuple[Measurement, list[Measurement]]:
    """The replay figure (taken on every server) and the kit's own figures, on the generated session."""
    proto = first.protocol
    assert proto is not None  # learnt by the probe
    with console.status(f"writing the kit's {size_label(plan.session_bytes)} session as a pcap"):
        files = SessionFiles(proto, plan.session_bytes, plan.session_chunk)
    stack.callback(files.close)
    label = f"{size_label(files.session.data_bytes)} session"
    graph_goal = GOAL_GRAPH_DECODE if plan.graph_tensors == 10_000 else None
    kit: list[Measurement] = [PcapWrite(files, GOAL_PCAP_WRITE), GraphDecode(proto, plan.graph_tensors, graph_goal)]
    if args.capture is None:
        kit.append(PcapDecode(files.pcap, label, GOAL_DECODE))
        return Replay(files, label, GOAL_REPLAY), kit
    kit.append(PcapDecode(args.capture, args.capture.name, GOAL_DECODE))
    # The replay goal is set for a session of bulk data; a real session also computes: no goal.
    return Replay(_load_capture(args.capture), args.capture.name), kit


def _print_results(
    console: Console, server: Sequence[FigureResult], kit: Sequence[FigureResult], names: Sequence[str],
    comparisons: Sequence[dict],
) -> list[tuple[str, str, str]]:
    """The tables, the bulk comparisons and the errors; returns the errors as (figure, target, error)."""
    console.print(figures_table("Servers", server, names))
    if kit:
        console.print(figures_table("Kit", kit, ["kit"]))
    for c in comparisons:
        style = "green" if c["met"] else "red"
        console.print(f"reference at [{style}]{c['reference_vs_target']:.2f}x[/{style}] of {c['target']} on "
                      f"{c['label']} (goal >= {BULK_RATIO_GOAL}x)")
    failed = [(f.figure.label, r.target, r.error) for f in (*server, *kit) for r in f.results if r.error]
    for label, target, error in failed:
        console.print(f"[red]error[/red] {label} on {target}: {error}")
    return failed


def bulk_comparisons(results: Sequence[FigureResult], names: Sequence[str], plan: Plan) -> list[dict]:
    """The reference server's speed relative to each other server on the largest SET and GET transfers."""
    if not names or names[0] != "reference":
        return []
    size = max(s for s, _ in plan.transfers)
    bulk = {f"set_tensor_{size_label(size).replace(' ', '')}", f"get_tensor_{size_label(size).replace(' ', '')}"}
    out = []
    for fr in results:
        if fr.figure.key not in bulk or fr.results[0].stats is None:
            continue
        ref = fr.results[0].stats.median
        for r in fr.results[1:]:
            if r.stats is not None and r.stats.median > 0:
                ratio = ref / r.stats.median
                out.append({"figure": fr.figure.key, "label": fr.figure.label, "target": r.target,
                            "reference_vs_target": ratio, "goal": BULK_RATIO_GOAL, "met": ratio >= BULK_RATIO_GOAL})
    return out


def _load_capture(path: Path) -> list:
    from ..sessions.replay import ReplayError, load_captures

    try:
        return load_captures([path])
    except (ReplayError, OSError) as exc:
        raise UsageError(f"--capture {path}: {exc}") from None
    except Exception as exc:  # a capture that is not a pcap at all
        raise UsageError(f"--capture {path}: cannot read it: {exc}") from None


def command_line(args: argparse.Namespace) -> str:
    """The options of this run as a command line (kept in the JSON record)."""
    argv = ["ggml-rpc", "bench"]
    for spec in args.server:
        argv += ["--server", spec]
    flags = (("--no-reference", args.no_reference), ("--quick", args.quick), ("--no-kit", args.no_kit),
             ("--no-upstream", args.no_upstream))
    argv += [flag for flag, on in flags if on]
    if args.proto != "7":
        argv += ["--proto", args.proto]
    if args.repeat is not None:
        argv += ["--repeat", str(args.repeat)]
    if args.capture is not None:
        argv += ["--capture", str(args.capture)]
    if args.generation is not None:
        argv += ["--generation", str(args.generation)]
    return shlex.join(argv)


def plan_text(plan: Plan, repeat: int, args: argparse.Namespace) -> str:
    sizes = ", ".join(size_label(s) for s, _ in plan.transfers)
    kit = "" if args.no_kit else f"; kit session {size_label(plan.session_bytes)}"
    return (f"{'quick' if args.quick else 'full'} run: transfers {sizes}; graph {plan.graph_tensors:,} tensors; "
            f"{repeat} interleaved samples per figure and target{kit}")


__all__ = ["FULL", "QUICK", "Plan", "command_line", "add_arguments", "run"]
