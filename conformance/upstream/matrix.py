"""The interop matrix: genuine upstream peers against the kit's verdicts, its reference server and its tools.

Rows are data (an ID, a title, the protocol version, a function returning a :class:`Cell`), like the checks of the
conformance suite. A row passes only when what it states held against the real upstream programs.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ggml_rpc.conformance.harness import parse_address
from ggml_rpc.conformance.harness.verdict import LEAK_CHECKS
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.proxy import running_proxy
from ggml_rpc.conformance.sessions.replay import replay
from ggml_rpc.spec import Command, Reply

from .cells import FAIL, PASS, UNSUPPORTED, Cell, Row, RowResult
from .gguf_tensors import tensor_infos
from .known_bugs import explained_checks
from .peers import Peer, peers_of
from .runs import UpstreamServer, abort_reason, completion, completion_argv, generated_text, kit, reference_server
from .split_rows import split_rows
from .workspace import Workspace

#: The size above which upstream clients hash a tensor before sending it (SET_TENSOR_HASH).
HASH_MIN_SIZE = 10 * 1024 * 1024


def _same_text_detail(same_as_cpu: bool) -> str:
    other = " (upstream's own CPU-only run prints another)"
    return "same text as upstream's own server" + (" and as CPU-only" if same_as_cpu else other)


def _cache_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".tmp") if folder.is_dir() else []


def hashed_tensors(model: Path) -> list[str]:
    """Tensors an upstream client hashes before sending: above 10 MiB and offloaded (token_embd stays on the CPU)."""
    return [t.name for t in tensor_infos(model) if t.nbytes > HASH_MIN_SIZE and t.name != "token_embd.weight"]


def _hash_results(pcap: Path) -> list[int]:
    """SET_TENSOR_HASH replies of a recorded session (1 = hit, 0 = miss), in order."""
    out = []
    for dc in decode_file(pcap):
        for msg in dc.messages():
            if isinstance(msg, Reply) and msg.command is Command.SET_TENSOR_HASH:
                out.append(int(msg.fields["result"]))
    return out


def _through_proxy(peer: Peer, model: Path, address: str, pcap: Path) -> tuple[Any, list[str]]:
    """Run llama-completion through the kit's checking proxy in front of ``address``; (finished, violations)."""
    violations: list[str] = []
    with running_proxy(parse_address(address), pcap=pcap, check=True,
                       on_violation=lambda v: violations.append(v.line())) as proxy:
        done = completion(peer, model, f"{proxy.host}:{proxy.port}")
    return done, violations


# ---- the rows -----------------------------------------------------------------------------------------------------


def client_line(peer: Peer, model: str) -> str:
    """The client command a recording names (the PROXY address in place of the port)."""
    if peer.kind in ("sdist", "debian"):
        argv = completion_argv(peer, Path(f"{model}.gguf"), "PROXY")
        return "llama-completion " + " ".join(argv[argv.index(str(peer.llama_completion)) + 1:])
    argv = peer.generate_argv(Path(f"{model}.gguf"), "PROXY")
    return "python -m " + " ".join(argv[argv.index("-m") + 1:])


def server_name(peer: Peer) -> str:
    return {"sdist": "rpc-server", "debian": "ggml-rpc-server (Debian's llama.cpp-tools-extra)"}.get(
        peer.kind, "ggml_backend_rpc_start_server (the kit's wheel_peer serve)")


#: What each kind of peer's client is, in row titles.
CLIENTS = {"sdist": "llama-completion", "wheel": "client (wheel, Llama)", "debian": "llama-completion (Debian)"}


#: A genuine upstream server passes at least this many checks (what it does right must stay judged right).
MIN_UPSTREAM_PASSES = 80


def check_row(peer: Peer, ws: Workspace) -> Cell:
    """The conformance suite against upstream rpc-server -c: the verdict must be right about upstream.  Upstream
    dies on some bad input (that is what the suite finds), so the row passes when the run is judged, every failure
    is a death with its evidence (signal, step), the known leak of another allocation's bytes (DATA-030) or a check
    of a known upstream bug (SECURITY.md's table: the silent ones of a release build), and at least the checks of
    everything upstream does right pass; any other failure without a death is a kit bug or a real upstream
    regression, and fails the row."""
    server = UpstreamServer(peer, cache=True, llama_cache=Path(tempfile.mkdtemp(dir=ws.root, prefix="llama-cache-")))
    server.cache_dir.mkdir(parents=True, exist_ok=True)
    out = ws.root / f"check-{peer.label}.json"
    done = kit("check", "--spawn", server.spawn_command(), "--cache-dir", str(server.cache_dir), "--json", str(out))
    if not out.is_file():
        return Cell(FAIL, f"ggml-rpc check produced no report: {done.why()}")
    report = json.loads(out.read_text())
    s, verdict = report["summary"], report.get("verdict", {})
    deaths = [f"{r['id']} {r['server_death'].get('status', '?').replace('killed by signal ', '')}"
              for r in report["results"] if r.get("server_death")]
    failed = [r for r in report["results"] if r["outcome"] in ("fail", "error")]
    silent = [r["id"] for r in failed if not r.get("server_death")]
    # Known upstream bugs, and the verdict's own list of leak findings.
    known = [c for c in silent if c in set(explained_checks()) | LEAK_CHECKS]
    unexplained = [c for c in silent if c not in known]
    figures = {"summary": s, "deaths": deaths, "verdict": verdict.get("state"), "exit_code": done.code,
               "known_bugs_without_death": known, "failures_without_death": unexplained}
    detail = (f"{s['pass']} pass; verdict {verdict.get('state', '?')} (exit {done.code}); {len(deaths)} deaths: "
              f"{', '.join(deaths) or 'none'}; known bugs without a death: {', '.join(known) or 'none'}")
    if verdict.get("state") not in ("conformant", "not conformant") or done.code not in (0, 1):
        return Cell(FAIL, f"{detail}: the run was not judged", figures)
    if bool(failed) != (done.code == 1):
        return Cell(FAIL, f"{detail}: the exit code does not follow the failures", figures)
    if unexplained:
        return Cell(FAIL, f"{detail}; failures without a death: {', '.join(unexplained)}", figures)
    if s["pass"] < MIN_UPSTREAM_PASSES:
        return Cell(FAIL, f"{detail}: fewer than {MIN_UPSTREAM_PASSES} checks pass", figures)
    return Cell(PASS, detail, figures)


def completion_reference_row(peer: Peer, ws: Workspace, model: str) -> Cell:
    """Upstream llama-completion -> reference server of the same version: the text upstream's own server gives;
    the cache rule of the version."""
    expected, same_as_cpu = ws.expected_text(peer, model)
    hashed = len(hashed_tensors(ws.models(peer)[model]))
    with tempfile.TemporaryDirectory(dir=ws.root, prefix="ref-cache-") as cache:
        with reference_server(peer.major, Path(cache)) as address:
            cold_pcap = ws.root / f"ref-{peer.label}-{model}-cold.pcap"
            done, violations = _through_proxy(peer, ws.models(peer)[model], address, cold_pcap)
            if not done.ok:
                return Cell(FAIL, f"cold run: {done.why()}")
            files = _cache_files(Path(cache))
            warm_pcap = ws.root / f"ref-{peer.label}-{model}-warm.pcap"
            warm, warm_violations = _through_proxy(peer, ws.models(peer)[model], address, warm_pcap)
    problems = []
    if generated_text(done.stdout) != expected:
        problems.append(f"text differs from upstream's own server's: {generated_text(done.stdout)!r} vs {expected!r}")
    if not warm.ok:
        problems.append(f"warm run: {warm.why()}")
    elif generated_text(warm.stdout) != expected:
        problems.append("warm run's text differs from upstream's own server's")
    if violations or warm_violations:
        problems.append(f"{len(violations) + len(warm_violations)} violations: {(violations + warm_violations)[0]}")
    if len(files) != hashed:
        problems.append(f"cold run left {len(files)} cache files, expected {hashed}")
    cold_hits, warm_hits = _hash_results(cold_pcap), _hash_results(warm_pcap)
    if hashed and (cold_hits.count(1) != 0 or warm_hits.count(1) != hashed):
        problems.append(f"hash replies cold {cold_hits}, warm {warm_hits}: expected misses then {hashed} hit(s)")
    figures = {"cache_files": len(files), "hash_cold": cold_hits, "hash_warm": warm_hits,
               "seconds_cold": round(done.seconds, 2), "seconds_warm": round(warm.seconds, 2),
               "same_as_cpu_only": same_as_cpu,
               "cpu_only_texts_disagreed": ws.baseline_disagreements.get((peer.label, model))}
    if problems:
        return Cell(FAIL, "; ".join(problems), figures)
    return Cell(PASS, f"{_same_text_detail(same_as_cpu)}; {len(files)} cache file(s) after the cold run, warm run "
                      f"hit {warm_hits.count(1)}", figures)


def proxy_upstream_row(peer: Peer, ws: Workspace, model: str) -> Cell:
    """Upstream client -> ggml-rpc proxy --check --pcap -> upstream server: no violation, the text it gives without
    the proxy; keeps the pcap."""
    expected, same_as_cpu = ws.expected_text(peer, model)
    pcap = ws.pcap_dir / f"{peer.tag}-upstream-{model}-cold.pcap"
    with UpstreamServer(peer, cache=True) as server:
        done, violations = _through_proxy(peer, ws.models(peer)[model], server.address, pcap)
        files = _cache_files(server.cache_dir)
    if not done.ok:
        return Cell(FAIL, f"{done.why()}")
    ws.recorded[(peer.label, model)] = pcap
    ws.record(pcap, protocol=peer.version, package=peer.requirement, model=model, client=client_line(peer, model),
              server=f"{server_name(peer)} with a cache directory ({peer.version}), empty", scenario="generation-cold",
              hashed=hashed_tensors(ws.models(peer)[model]))
    if hashed_tensors(ws.models(peer)[model]):
        # A second run against the same server cache: the weights above 10 MiB are found by hash.
        warm_pcap = ws.pcap_dir / f"{peer.tag}-upstream-{model}-warm.pcap"
        with UpstreamServer(peer, cache=True, llama_cache=ws.root / f"warm-cache-{peer.label}") as server:
            completion(peer, ws.models(peer)[model], server.address)
            warm, warm_violations = _through_proxy(peer, ws.models(peer)[model], server.address, warm_pcap)
        hits = _hash_results(warm_pcap)
        if not warm.ok or warm_violations or generated_text(warm.stdout) != expected or 0 in hits or not hits:
            return Cell(FAIL, f"warm run against upstream: {warm.why()}, hash replies {hits}, "
                              f"{len(warm_violations)} violations")
        ws.record(warm_pcap, protocol=peer.version, package=peer.requirement, model=model,
                  client="the same client command, second run",
                  server=f"{server_name(peer)} ({peer.version}), cache filled by a first run",
                  scenario="generation-warm",
                  hashed=hashed_tensors(ws.models(peer)[model]))
    problems = []
    if generated_text(done.stdout) != expected:
        problems.append("text differs from the same run without the proxy")
    if violations:
        problems.append(f"{len(violations)} violations, first: {violations[0]}")
    figures = {"violations": len(violations), "pcap": pcap.name, "pcap_bytes": pcap.stat().st_size,
               "upstream_cache_files": len(files), "same_as_cpu_only": same_as_cpu}
    if problems:
        return Cell(FAIL, "; ".join(problems), figures)
    return Cell(PASS, f"0 violations, the text it gives without the proxy"
                      f"{'' if same_as_cpu else ' (not the CPU-only one)'}; recorded {pcap.name} "
                      f"({pcap.stat().st_size:,} bytes)", figures)


def cross_version_row(client: Peer, server: Peer, ws: Workspace, model: str) -> Cell:
    """A client of one major version against a server of the other refuses, upstream and reference alike."""
    outcomes = {}
    pcap = ws.pcap_dir / f"{client.tag}client-{server.tag}server-hello.pcap"
    with UpstreamServer(server, cache=False) as up:
        with running_proxy(parse_address(up.address), pcap=pcap) as proxy:
            outcomes["upstream"] = completion(client, ws.models(client)[model], f"{proxy.host}:{proxy.port}",
                                              timeout=120)
        up_alive = up.alive()
    ws.record(pcap, protocol=f"{client.version} client, {server.version} server", model=model,
              package=f"{client.requirement} client, {server.requirement} server",
              client=f"{client_line(client, model)} (the {client.version} client)",
              server=f"{server_name(server)} ({server.version})",
              scenario="version-mismatch")
    with reference_server(server.major, None) as address:
        outcomes["reference"] = completion(client, ws.models(client)[model], address, timeout=120)
    figures: dict[str, Any] = {name: abort_reason(done.stderr) for name, done in outcomes.items()}
    figures["upstream_server_alive_after"] = up_alive
    refused = {name: not done.ok for name, done in outcomes.items()}
    if not all(refused.values()):
        wrong = [name for name, r in refused.items() if not r]
        return Cell(FAIL, f"the {client.tag} client ran against the {server.tag} {', '.join(wrong)} server",
                    figures)
    if figures["upstream"] != figures["reference"]:
        return Cell(FAIL, f"refused differently: upstream {figures['upstream']!r}, reference "
                          f"{figures['reference']!r}", figures)
    return Cell(PASS, f"both servers refused alike: {figures['upstream']} ({outcomes['upstream'].why().split(':')[0]})",
                figures)


def cross_build_row(client: Peer, server: Peer, ws: Workspace, model: str) -> Cell:
    """Two genuine builds of one version (the wheel's, Debian's): the client of one through ``proxy --check`` to the
    server of the other runs the session with no violation and prints the text it prints with its own build's
    server."""
    expected = ws.upstream_text(client, model)
    pcap = ws.pcap_dir / f"{client.tag}client-{server.tag}server-{model}.pcap"
    with UpstreamServer(server, cache=False) as up:
        done, violations = _through_proxy(client, ws.models(client)[model], up.address, pcap)
    figures: dict[str, Any] = {"violations": len(violations), "pcap": pcap.name,
                               "seconds_generation": round(done.seconds, 2)}
    if not done.ok:
        return Cell(FAIL, f"the {client.tag} client failed against the {server.tag} server: {done.why()}", figures)
    ws.record(pcap, protocol=server.version, model=model, package=f"{client.requirement} client, "
              f"{server.requirement} server", client=f"{client_line(client, model)} (the {client.label} client)",
              server=f"{server_name(server)} ({server.label})", scenario="cross-build")
    problems = []
    text = generated_text(done.stdout)
    figures["same_as_own_server"] = text == expected
    if text != expected:
        problems.append(f"text differs from the {client.label} client's with its own server: {text!r} vs "
                        f"{expected!r}")
    if violations:
        problems.append(f"{len(violations)} violations, first: {violations[0]}")
    if problems:
        return Cell(FAIL, "; ".join(problems), figures)
    return Cell(PASS, f"0 violations, the text the {client.label} client gives with its own server; recorded "
                      f"{pcap.name} ({pcap.stat().st_size:,} bytes)", figures)


def check_wrong_proto_row(expected: str, server: Peer, ws: Workspace) -> Cell:
    """``ggml-rpc check --proto N`` against an upstream server of another version: the verdict says so."""
    out = ws.root / f"check-proto{expected}-vs-{server.label}.json"
    with UpstreamServer(server, cache=False) as up:
        done = kit("check", "--server", up.address, "--proto", expected, "--checks", "HELLO-*", "--json", str(out),
                   timeout=120)
    verdict = ""
    if out.is_file():
        verdict = json.loads(out.read_text())["server"].get("verdict") or ""
    text = (verdict + " " + done.stdout + done.stderr).lower()
    if done.code != 0 and ("version" in text or "mismatch" in text):
        return Cell(PASS, f"exit {done.code}: {verdict or done.stderr.strip().splitlines()[-1][:160]}",
                    {"verdict": verdict})
    return Cell(FAIL, f"exit {done.code}, verdict {verdict!r}", {"verdict": verdict})


#: The closeness a replay row asks of every computed read: upstream's results reproduced to NMSE 1e-9, where
#: replay's own tolerance (test-backend-ops') only separates a right result from a wrong one.
REPLAY_NMSE_BAR = 1e-9


def _above_bar(by_op: dict[str, dict[str, Any]], bar: float) -> str:
    """The ops whose reads were above ``bar``, worst first, with the source 0 types that were."""
    worst = sorted(((fig["worst_nmse"], op, fig) for op, fig in by_op.items() if fig["worst_nmse"] > bar),
                   reverse=True)
    parts = []
    for nmse, op, fig in worst:
        types = [t for t, sub in fig.get("by_src0_type", {}).items() if sub["worst_nmse"] > bar]
        parts.append(f"{op} {nmse:.1e}" + (f" ({', '.join(types)})" if types else ""))
    return ", ".join(parts)


def replay_row(peer: Peer, ws: Workspace, model: str, against: str) -> Cell:
    """``ggml-rpc replay`` of the recorded upstream session against the reference server or upstream: 0 mismatches;
    for a zoo model, every computed read within :data:`REPLAY_NMSE_BAR` of upstream's (the standard models' rows
    report where they stand against it)."""
    pcap = ws.recorded.get((peer.label, model))
    if pcap is None:
        return Cell(UNSUPPORTED, "no recorded session (its proxy row did not pass)")
    if against == "reference":
        with tempfile.TemporaryDirectory(dir=ws.root, prefix="ref-cache-") as cache, \
                reference_server(peer.major, Path(cache)) as address:
            report = replay([pcap], *parse_address(address))
    else:
        with UpstreamServer(peer, cache=True) as server:
            report = replay([pcap], *parse_address(server.address))
    figures = {"requests": report.requests, "compared": report.compared, "worst_nmse": report.worst_nmse,
               "mismatches": len(report.mismatches), "nmse_bar": REPLAY_NMSE_BAR, "nmse_by_op": report.nmse_by_op}
    if report.mismatches:
        return Cell(FAIL, f"{len(report.mismatches)} mismatches, first: {report.mismatches[0]}", figures)
    if not report.compared.get("computed"):
        # A session of a generation whose results were never compared judged nothing: never a pass.
        return Cell(FAIL, f"{report.requests} requests, but no computed result was compared", figures)
    over = report.worst_nmse > REPLAY_NMSE_BAR
    # The worst read may be of an address no graph node names: over the bar all the same.
    above = (_above_bar(report.nmse_by_op, REPLAY_NMSE_BAR) or "a read no graph node names") if over else ""
    figures["bar_met"] = not over
    if above and model in ws.zoo:
        return Cell(FAIL, f"{report.requests} requests, 0 mismatches, but worst NMSE {report.worst_nmse:.1e} is above "
                          f"{REPLAY_NMSE_BAR:.0e}: {above}", figures)
    where = f"above the {REPLAY_NMSE_BAR:.0e} bar: {above}" if above else f"within the {REPLAY_NMSE_BAR:.0e} bar"
    return Cell(PASS, f"{report.requests} requests, 0 mismatches (worst NMSE {report.worst_nmse:.1e}, {where})",
                figures)


def rows(versions: list[str], ws: Workspace, models: list[str], *, backend_ops: Callable[[], Iterator[Row]] | None
         = None) -> Iterator[Row]:
    """Every row of the matrix for ``versions`` (each version's release peer and Debian's build of it when
    installed: :func:`.peers.peers_of`), in the order they run."""
    chosen = peers_of(versions)
    for peer in chosen:
        v = peer.tag
        yield Row(f"CHECK-{v}", f"ggml-rpc check --spawn upstream {v} rpc server with a cache directory", peer.version,
                  lambda p=peer: check_row(p, ws))
        for model in [*models, *ws.zoo]:
            yield Row(f"GEN-{v}-REF-{model}", f"upstream {v} {CLIENTS[peer.kind]} -> reference v{peer.major}, {model}",
                      peer.version, lambda p=peer, m=model: completion_reference_row(p, ws, m))
            yield Row(f"GEN-{v}-PROXY-{model}", f"upstream {v} client -> proxy --check -> upstream {v}, {model}",
                      peer.version, lambda p=peer, m=model: proxy_upstream_row(p, ws, m))
            for against in ("reference", "upstream"):
                yield Row(f"REPLAY-{v}-{against.upper()}-{model}",
                          f"replay of the upstream {v} {model} session -> "
                          f"{'upstream ' + v if against == 'upstream' else f'reference v{peer.major}'}", peer.version,
                          lambda p=peer, m=model, a=against: replay_row(p, ws, m, a))
        # The other genuine builds of the version serve beside this one in a split of its own.
        yield from split_rows(peer, ws, models[0],
                              partners=[o for o in chosen if o.version == peer.version and o != peer])
    # Every pair of majors refuses each other, upstream and reference alike; the kit's check says so. Two builds
    # of one version work together.
    small = models[0]
    checked: set[tuple[int, str]] = set()
    for client in chosen:
        for server in chosen:
            c, s = client.tag, server.tag
            if client == server:
                continue
            if client.major == server.major:
                yield Row(f"CROSS-{c}-{s}", f"upstream {c} client -> proxy --check -> upstream {s} server, {small}",
                          server.version, lambda a=client, b=server: cross_build_row(a, b, ws, small))
                continue
            yield Row(f"CROSS-{c}-{s}", f"upstream {c} client -> {s} servers (upstream, reference) refuse",
                      f"{client.version}/{server.version}",
                      lambda a=client, b=server: cross_version_row(a, b, ws, small))
            if (client.major, s) in checked:
                continue
            checked.add((client.major, s))
            yield Row(f"CROSS-CHECK-{client.major}-{s}",
                      f"ggml-rpc check --proto {client.major} against upstream {s} reports the mismatch",
                      server.version, lambda a=client, b=server: check_wrong_proto_row(str(a.major), b, ws))
    if backend_ops is not None:
        yield from backend_ops()


def run_rows(selected: Iterator[Row], progress: Callable[[RowResult], None] | None = None) -> list[RowResult]:
    results = []
    for row in selected:
        started = time.monotonic()
        try:
            cell = row.run()
        except Exception as exc:  # a row that breaks is a failed row with the reason, and the matrix goes on
            cell = Cell(FAIL, f"the row could not run: {type(exc).__name__}: {exc}")
        res = RowResult(row.id, row.title, row.proto, cell.status, cell.detail, round(time.monotonic() - started, 1),
                        cell.figures)
        results.append(res)
        if progress:
            progress(res)
    return results


def as_json(results: list[RowResult], meta: dict[str, Any]) -> dict[str, Any]:
    return {"format": "ggml-rpc-interop/1", **meta, "rows": [asdict(r) for r in results]}
