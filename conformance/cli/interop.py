"""``ggml-rpc interop``: the matrix of genuine upstream peers against the kit (suite, reference server, tools)."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tempfile
import time
from pathlib import Path

from .console import ready_kernels
from .options import UsageError, one_stdout, output_file, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run genuine upstream llama.cpp (installed by `ggml-rpc upstream install`) against the kit: "
        "the conformance suite against upstream rpc-server, upstream llama-completion through the reference "
        "server and through the checking proxy, replays of the recorded sessions, cross-version refusals and "
        "upstream test-backend-ops through the reference server. Exit code 0 only when every row passes."
    )
    p.add_argument("--proto", default="all", help="the upstream releases: 6, 7 or 8 (or in full: 6.0.0, 7.0), "
                   "all (every one; default)")
    p.add_argument("--rows", metavar="PATTERNS", help="comma-separated shell patterns on row IDs (default: all)")
    p.add_argument("--models", metavar="NAMES", help="comma-separated tiny models (default: all of them)")
    p.add_argument("--zoo", metavar="MODELS", nargs="?", const="all", default="ci",
                   help="zoo models (tiny models quantised by the peer's own llama-quantize, GQA shapes, qwen2/qwen3/"
                   "gemma, phi3, a mixture of experts, a recurrent mamba): --zoo alone or 'all' for every one, 'none', "
                   "or comma-separated names (default: 'ci', a representative subset)")
    p.add_argument("--ops", metavar="OPS", default=None,
                   help="test-backend-ops: comma-separated ops to run, 'all' for every op upstream tests "
                   "(long), 'none' to skip (default: the fixed CI subset)")
    p.add_argument("--pcap-dir", metavar="DIR", help="keep the recorded upstream sessions here (default: a temp dir)")
    p.add_argument("--json", metavar="FILE|-", help="write the results as JSON ('-': standard output)")
    p.add_argument("--markdown", metavar="FILE|-", help="write the results as Markdown (INTEROP.md; '-': standard "
                   "output)")
    p.add_argument("--html", metavar="DIR", help="write DIR/index.html: the version x role matrix and every row")
    p.add_argument("--list", action="store_true", help="print the rows and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..upstream import interop_report, matrix
    from ..upstream.models import STANDARD_MODELS
    from ..upstream.peers import PEERS, cache_root, versions_option
    from ..upstream.zoo import zoo_option

    try:
        versions = versions_option(args.proto)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # With a report on standard output, the row lines go to standard error: stdout stays one document.
    rows_out = sys.stderr if one_stdout(json=args.json, markdown=args.markdown) else sys.stdout
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path:
            output_file(path, option)
    if args.html and Path(args.html).exists() and not Path(args.html).is_dir():
        raise UsageError(f"--html {args.html}: exists and is not a directory")
    models = list(STANDARD_MODELS) if not args.models else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in STANDARD_MODELS]
    if unknown:
        raise UsageError(f"--models: unknown model {unknown[0]!r} (choose from {', '.join(STANDARD_MODELS)})")
    try:
        zoo_models = zoo_option(args.zoo)
    except ValueError as exc:
        raise UsageError(f"--zoo: {exc}") from None
    missing = [v for v in versions if not PEERS[v].installed()]
    if missing and not args.list:
        raise UsageError(f"upstream {', '.join(missing)} not installed: run `ggml-rpc upstream install --proto "
                         f"{'all' if len(missing) > 1 else missing[0][0]}`")
    patterns = [p.strip() for p in args.rows.split(",")] if args.rows else ["*"]
    pcap_dir = Path(args.pcap_dir) if args.pcap_dir else None
    if pcap_dir is not None:
        pcap_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="ggml-rpc-interop-") as tmp:
        # Zoo files are named by everything that made them: they are kept between runs beside the peers.
        ws = matrix.Workspace(Path(tmp), pcap_dir, zoo=zoo_models, zoo_dir=cache_root() / "zoo")
        from ..upstream.backend_ops_rows import backend_ops_rows

        selected = [r for r in matrix.rows(versions, ws, models,
                                           backend_ops=lambda: backend_ops_rows(versions, ws, args.ops))
                    if any(fnmatch.fnmatchcase(r.id, p) for p in patterns)]
        if not selected:
            raise UsageError(f"--rows {args.rows!r} matches no row (see --list)")
        if args.list:
            for r in selected:
                print(f"{r.id:<44} {r.proto:<12} {r.title}")
            return 0

        def progress(res: matrix.RowResult) -> None:
            print(f"{res.id:<44} {res.status:<11} {res.seconds:>6.1f}s  {res.detail}", file=rows_out, flush=True)

        # The reference servers the rows start (`ggml-rpc serve` processes, embedded ones) load what this compiles:
        # no row's timeout runs while the kit compiles its own kernels.
        ready_kernels()
        # The commit and tree of the start: the code measured (the tree may change during a run of many minutes).
        meta = interop_report.metadata(versions)
        started = time.monotonic()
        results = matrix.run_rows(iter(selected), progress)
        seconds = time.monotonic() - started
    passed = sum(r.status == matrix.PASS for r in results)
    print(f"interop: {passed}/{len(results)} rows pass in {seconds:.0f} s", file=sys.stderr)
    if args.json:
        write_output(args.json, json.dumps(matrix.as_json(results, {**meta, "seconds": round(seconds, 1)}),
                                           indent=2) + "\n")
    if pcap_dir is not None and ws.manifest:
        manifest = {"doc": "Genuine upstream sessions recorded by `ggml-rpc interop --pcap-dir` through the checking "
                    "proxy (upstream llama-completion -> upstream rpc-server).", "fixtures": ws.manifest}
        (pcap_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if args.markdown:
        write_output(args.markdown, interop_report.render_markdown(results, meta, seconds))
    if args.html:
        Path(args.html).mkdir(parents=True, exist_ok=True)
        (Path(args.html) / "index.html").write_text(interop_report.render_html(results, meta, seconds))
    return 0 if passed == len(results) else 1
