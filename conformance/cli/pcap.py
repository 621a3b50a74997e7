"""``ggml-rpc pcap record --scenario NAME [--proto 6|7] -o OUT.pcap``: record a named client session as a pcap."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from ggml_rpc.spec import ProtocolError

from ..client import ConnectionClosed
from ..sessions.pcapwrite import MAX_MSS
from ..sessions.recording import Recording, record
from ..sessions.scenarios import SCENARIOS
from ..upstream.codebooks import tables  # a fresh reference server's IQ codebooks: an installed upstream peer's
from .options import UsageError, output_file, parse_address, proto_help

MANIFEST_DOC = ("Sessions recorded by `ggml-rpc pcap record` (the kit's client, through the recording proxy, against "
                "the reference server). Re-record them all with `ggml-rpc pcap record --all fixtures/`.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    pcap_sub = p.add_subparsers(dest="pcap_command", metavar="ACTION")
    pcap_sub.required = True
    rec = pcap_sub.add_parser("record", help="run a scenario and write what went over the wire",
                              description="Scenarios: " + "; ".join(f"{s.name} (v{'/v'.join(map(str, s.majors))}): "
                                                                      f"{s.exercises}" for s in SCENARIOS.values()))
    rec.add_argument("--scenario", choices=sorted(SCENARIOS), help="the session to run")
    rec.add_argument("--proto", default="7", help="protocol version: " + proto_help("7"))
    rec.add_argument("-o", "--output", metavar="FILE|-", help="pcap file to write ('-': standard output, the "
                     "summary then goes to standard error)")
    rec.add_argument("--server", default=None, metavar="HOST:PORT",
                     help="record against this server (default: a fresh reference server with the hash cache on)")
    rec.add_argument("--mss", type=int, default=None, help="TCP segment size in the pcap (default 65495)")
    rec.add_argument("--hash-weight-bytes", type=int, default=64 * 1024, metavar="N",
                     help="size of model-load's hash-path weight (default 64 KiB, to keep fixtures small; upstream "
                     "clients hash only transfers above 10 MiB = 10485760 bytes)")
    rec.add_argument("--all", default=None, metavar="DIR",
                     help="record every scenario for every version it exists in into DIR, with manifest.json")
    rec.set_defaults(func=run_record)
    lst = pcap_sub.add_parser("scenarios", help="list the scenarios")
    lst.set_defaults(func=run_list)


def run_list(args: argparse.Namespace) -> int:
    for s in SCENARIOS.values():
        print(f"{s.name:18} v{'/v'.join(map(str, s.majors)):6} {s.exercises}")
    return 0


def fixture_name(scenario: str, proto: str) -> str:
    return f"v{proto}-{scenario}.pcap"


def record_all(directory: Path, *, mss: int | None = None) -> list[Recording]:
    """Every scenario in every version it exists in, plus ``manifest.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for sc in SCENARIOS.values():
        for major in sc.majors:
            out.append(record(sc.name, str(major), directory / fixture_name(sc.name, str(major)), mss=mss,
                              codebooks=tables))
    manifest = {"doc": MANIFEST_DOC, "fixtures": [r.manifest_entry() for r in out]}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def _record_to_stdout(args: argparse.Namespace) -> int:
    """``-o -``: record into a temporary file (the writer seeks), then copy it to standard output; the summary
    goes to standard error."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ggml-rpc-pcap-") as tmp:
        path = str(Path(tmp) / "out.pcap")
        stdout, sys.stdout = sys.stdout, sys.stderr
        try:
            code = run_record(argparse.Namespace(**{**vars(args), "output": path}))
        finally:
            sys.stdout = stdout
        if code == 0:
            sys.stdout.flush()
            with open(path, "rb") as fh:
                shutil.copyfileobj(fh, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        return code


def run_record(args: argparse.Namespace) -> int:

    if args.mss is not None and not 1 <= args.mss <= MAX_MSS:
        raise UsageError(f"--mss must be 1..{MAX_MSS}")
    if args.hash_weight_bytes < 1:
        raise UsageError("--hash-weight-bytes must be at least 1")
    if args.all:
        if args.scenario or args.output or args.server:
            raise UsageError("--all records every scenario against fresh reference servers: no --scenario, -o or "
                             "--server with it")
        if Path(args.all).exists() and not Path(args.all).is_dir():
            raise UsageError(f"--all {args.all}: not a directory")
        try:
            recordings = record_all(Path(args.all), mss=args.mss)
        except OSError as exc:
            raise UsageError(f"--all {args.all}: {exc.strerror or exc}") from None
        for r in recordings:
            print(f"{r.path}: {r.scenario} v{r.protocol}, {r.stats.connections} connection(s), "
                  f"{r.stats.requests} request(s)")
        return 0
    if not args.scenario or not args.output:
        raise UsageError("--scenario and -o are required (or --all DIR)")
    output_file(args.output, "-o")
    if args.output == "-":
        return _record_to_stdout(args)
    server = parse_address(args.server, "--server") if args.server else None
    if server is not None:
        # Reach the server before the recording proxy starts, so an address mistake is one line, not a broken run.
        try:
            socket.create_connection(server, timeout=10).close()
        except OSError as exc:
            raise UsageError(f"cannot reach {args.server}: {exc.strerror or exc}") from None
    try:
        r = record(args.scenario, args.proto, args.output, server=server, mss=args.mss,
                   hash_weight_bytes=args.hash_weight_bytes, codebooks=tables)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"recording failed: {exc}") from None
    except (ConnectionClosed, ProtocolError) as exc:
        # The server under test broke the scenario: not a usage mistake, but no traceback either.
        print(f"ggml-rpc pcap: the scenario failed against {args.server}: {exc}", file=sys.stderr)
        return 1
    print(f"{r.path}: {r.scenario} v{r.protocol}, {r.stats.connections} connection(s), {r.stats.requests} "
          f"request(s), {r.stats.bytes_c2s + r.stats.bytes_s2c} bytes")
    for note in r.notes:
        print(f"  {note}")
    return 0
