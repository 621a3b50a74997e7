"""How close the reference executor computes each op to upstream: worst NMSE per op for upstream's own inputs.

Upstream ``test-backend-ops`` runs one op through upstream's own rpc-server, recorded by the kit's proxy; the
recording is then replayed twice: on the reference server (its results for the very inputs upstream had, compared
with upstream's recorded results) and on a fresh upstream server (upstream against itself: whether upstream is
deterministic for the op).  test-backend-ops reads every node of each case's graph back, so every case of the op is
compared; :mod:`..sessions.op_closeness` attributes each read to the node that computed it.

``python -m ggml_rpc.conformance.upstream.closeness [--ops CI|all|A,B] [--record]`` measures and prints; ``--record``
merges the result into ``conformance/upstream/op_closeness.json``, which reference/OPS.md's closeness section is
rendered from (:func:`section`).  Nothing here writes a figure it did not measure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..harness import parse_address
from ..provenance import git_state
from ..sessions.proxy import running_proxy
from .backend_ops_rows import CI_OPS, ops_from_option
from .interpose import run_backend_ops
from .peers import Peer, peer_for
from .runs import UpstreamServer, reference_server

CLOSENESS_FILE = Path(__file__).resolve().with_name("op_closeness.json")
FORMAT = "ggml-rpc-op-closeness/1"
#: The closeness bar: an op where upstream is deterministic is computed within this NMSE of upstream's result.
TARGET = 1e-9
#: Replays count a mismatch only beyond test-backend-ops' own loosest tolerance: the figure is the worst NMSE.
REPLAY_TOLERANCE = 5e-4
#: Recordings larger than this are not replayed by default (bytes).
MAX_CAPTURE = 8 * 10**9


def _replay(pcap: Path, address: str, timeout: float) -> dict[str, Any]:
    out = pcap.with_suffix(f".{address.rsplit(':', 1)[-1]}.json")
    done = subprocess.run([sys.executable, "-m", "ggml_rpc.conformance.cli", "replay", str(pcap), "--server", address,
                           "--nmse", str(REPLAY_TOLERANCE), "--json", str(out)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if not out.exists():
        raise RuntimeError(f"replay of {pcap.name} against {address} gave no report: {done.stderr.strip()[-300:]}")
    return json.loads(out.read_text())


def _side(report: dict[str, Any], op: str) -> dict[str, Any]:
    fig = report.get("nmse_by_op", {}).get(op) or {}
    deaths = sum(1 for m in report.get("mismatches", []) if m.get("kind") == "death")
    return {"reads": fig.get("reads", 0), "worst_nmse": fig["worst_nmse"] if fig.get("reads") else None,
            "by_src0_type": fig.get("by_src0_type", {}),
            "exact_reads": fig.get("exact_reads", 0), "exact_differ": fig.get("exact_differ", 0),
            "mismatches": len(report.get("mismatches", [])), "deaths": deaths}


def _try_side(pcap: Path, address: str, op: str, timeout: float) -> dict[str, Any]:
    """A replay's figures for ``op``, or what stopped the replay (it is then not compared, never judged met)."""
    try:
        return _side(_replay(pcap, address, timeout), op)
    except subprocess.TimeoutExpired:
        return {"error": f"the replay took longer than {timeout:g} s"}
    except (RuntimeError, ValueError) as exc:
        return {"error": str(exc)[:300]}


def measure_op(peer: Peer, op: str, workdir: Path, timeout: float = 900.0,
               max_capture: int = MAX_CAPTURE, params: str | None = None) -> dict[str, Any]:
    """One op: test-backend-ops through the recording proxy to upstream, then the two replays (not made of a
    recording larger than ``max_capture`` bytes: FLASH_ATTN_EXT's is 35 GB, whose cases can be taken a subset at a
    time with ``params``, test-backend-ops' filter of the cases' parameters)."""
    pcap = workdir / f"{op}.pcap"
    try:
        with UpstreamServer(peer, cache=False) as up, \
                running_proxy(parse_address(up.address), pcap=pcap, check=False) as proxy:
            run = run_backend_ops(peer, f"{proxy.host}:{proxy.port}", op, timeout=timeout, params=params)
        entry: dict[str, Any] = {"cases": run.total(op), "passed": run.passed.get(op, 0), "aborted": run.aborted,
                                 "capture_bytes": pcap.stat().st_size if pcap.exists() else 0,
                                 **({"params": params} if params else {})}
        if not pcap.exists() or entry["cases"] == 0:
            return {**entry, "reference": None, "upstream": None}
        if entry["capture_bytes"] > max_capture:
            why = {"error": f"its {entry['capture_bytes'] / 1e9:.1f} GB recording exceeds the {max_capture / 1e9:g} GB "
                            "this run replays"}
            return {**entry, "reference": why, "upstream": why}
        with reference_server(peer.major, None) as ref:
            entry["reference"] = _try_side(pcap, ref, op, timeout)
        with UpstreamServer(peer, cache=False) as again:
            entry["upstream"] = _try_side(pcap, again.address, op, timeout)
        return entry
    finally:
        for leftover in workdir.glob(f"{op}.*"):
            leftover.unlink()


def _commit() -> str:
    head, dirty = git_state(untracked=True)
    return head if dirty is None else head + (" (dirty tree)" if dirty else " (clean tree)")


def measure(peer: Peer, ops: Sequence[str], timeout: float = 900.0, max_capture: int = MAX_CAPTURE,
            params: str | None = None) -> dict[str, Any]:
    """Every op of ``ops``, one after the other; the run's date, commit, upstream build and machine with them.  With
    ``params``, only the cases whose parameters match it, recorded as the op's own row ``OP [PARAMS]``."""
    start = datetime.datetime.now(datetime.UTC)
    commit = _commit()  # the code measured is the code of the start: the tree may change while a long run goes on
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-closeness-") as tmp:
        for op in ops:
            key = f"{op} [{params}]" if params else op
            result[key] = measure_op(peer, op, Path(tmp), timeout, max_capture, params)
            print(f"{key}: {line(result[key])}", file=sys.stderr, flush=True)
    end = datetime.datetime.now(datetime.UTC)
    run = {"date": f"{start:%Y-%m-%d %H:%M} UTC to {end:%Y-%m-%d %H:%M} UTC", "commit": commit,
           "upstream": f"{peer.version} ({peer.requirement})",
           "machine": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"}
    return {"format": FORMAT, "runs": [run], "ops": {op: {**e, "run": 0} for op, e in result.items()}}


def load(path: Path = CLOSENESS_FILE) -> dict[str, Any]:
    if not path.exists():
        return {"format": FORMAT, "runs": [], "ops": {}}
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file")
    return data


def merge(into: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``into`` with the ops of ``new`` (one run) replacing theirs; runs no op refers to any more are dropped."""
    runs = list(into.get("runs", []))
    ops = dict(into.get("ops", {}))
    run = new["runs"][0]
    # Runs of one commit against one build on one machine are one run (a long campaign comes in several
    # invocations); its date then spans them.
    key = (run["commit"], run["upstream"], run["machine"])
    index = next((i for i, r in enumerate(runs) if (r["commit"], r["upstream"], r["machine"]) == key), len(runs))
    if index == len(runs):
        runs.append(run)
    else:
        first = runs[index]["date"].split(" to ")[0]
        runs[index] = {**runs[index], "date": f"{first} to {run['date'].split(' to ')[-1]}"}
    for op, entry in new["ops"].items():
        ops[op] = {**entry, "run": index}
    used = sorted({e["run"] for e in ops.values()})
    renumber = {old: i for i, old in enumerate(used)}
    return {"format": FORMAT, "runs": [runs[i] for i in used],
            "ops": {op: {**e, "run": renumber[e["run"]]} for op, e in sorted(ops.items())}}


def _nmse(value: float | None) -> str:
    return "—" if value is None else ("0 (bit for bit)" if value == 0 else f"{value:.1e}")


def verdict(entry: dict[str, Any]) -> str:
    """Whether the op meets :data:`TARGET` where upstream is deterministic, or why it is not judged."""
    ref, up = entry.get("reference"), entry.get("upstream")
    if not entry.get("cases"):
        return "no case on RPC0"
    if ref is None or up is None:
        return "not compared (no recording)"
    for side in (ref, up):
        if "error" in side:
            return f"not compared: {side['error']}"
    if ref["deaths"]:
        return "**the reference server died**"
    if ref["worst_nmse"] is None:
        if not ref.get("exact_reads"):
            return "not compared (no read of this op's results)"
        if up.get("exact_differ"):
            return "upstream not deterministic (exact outputs differ against itself): not judged"
        return "met (exact outputs)" if not ref.get("exact_differ") else (
            f"**not met** ({ref['exact_differ']} of {ref['exact_reads']} exact outputs differ)")
    if up["worst_nmse"] is None or up["worst_nmse"] > 0:
        return f"upstream not deterministic (NMSE {_nmse(up['worst_nmse'])} against itself): not judged"
    if ref.get("exact_differ"):
        return f"**not met** ({ref['exact_differ']} of {ref['exact_reads']} exact outputs differ)"
    return "met" if ref["worst_nmse"] <= TARGET else f"**not met** (> {TARGET:g})"


def above_bar(side: dict[str, Any]) -> str:
    """The source 0 types whose reads are farther than :data:`TARGET` from upstream's, worst first."""
    worse = sorted(((f["worst_nmse"], ty, f["reads"]) for ty, f in side.get("by_src0_type", {}).items()
                    if f["worst_nmse"] > TARGET), reverse=True)
    return ", ".join(f"{ty} {w:.1e} ({n} reads)" for w, ty, n in worse)


def line(entry: dict[str, Any]) -> str:
    ref = entry.get("reference") or {}
    return (f"{entry.get('passed', 0)}/{entry.get('cases', 0)} cases upstream; reference worst NMSE "
            f"{_nmse(ref.get('worst_nmse'))} over {ref.get('reads', 0)} reads "
            f"(+ {ref.get('exact_reads', 0)} exact): {verdict(entry)}")


def section(data: dict[str, Any] | None = None) -> list[str]:
    """reference/OPS.md's closeness section (from ``op_closeness.json`` unless ``data`` is given)."""
    data = load() if data is None else data
    lines = ["## Closeness to upstream, op by op", ""]
    if not data.get("ops"):
        return [*lines, "No closeness run is recorded yet (`python -m ggml_rpc.conformance.upstream.closeness "
                        "--record`).", ""]
    lines += ["Upstream `test-backend-ops -o OP` through upstream's own rpc-server, recorded by `ggml-rpc proxy`; the "
              "recording replayed on the reference server (its results for upstream's very inputs) and on a fresh "
              "upstream server (upstream against itself). Worst NMSE over every read of the op's results "
              f"(`replay --json`'s `nmse_by_op`); the bar is {TARGET:g} where upstream is deterministic. Runs:", ""]
    for i, run in enumerate(data["runs"]):
        lines.append(f"{i + 1}. {run['date']}, commit {run['commit']}, upstream {run['upstream']}; {run['machine']}")
    lines += ["", "| op | cases (upstream passed/total) | reads compared | reference vs upstream | upstream vs itself "
              "| verdict | above the bar, by source 0 type | run |", "|---|---|---|---|---|---|---|---|"]
    for op, e in data["ops"].items():
        ref, up = e.get("reference") or {}, e.get("upstream") or {}
        reads = f"{ref.get('reads', 0)}" + (f" + {ref['exact_reads']} exact" if ref.get("exact_reads") else "")
        cell = op.replace("|", "\\|")  # a case filter's alternatives must not split the table's row
        lines.append(f"| {cell} | {e.get('passed', 0)}/{e.get('cases', 0)} | {reads} | "
                     f"{_nmse(ref.get('worst_nmse'))} | {_nmse(up.get('worst_nmse'))} | {verdict(e)} | "
                     f"{above_bar(ref)} | {e['run'] + 1} |")
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ggml_rpc.conformance.upstream.closeness")
    p.add_argument("--ops", default=None, help="CI (default: " + ",".join(CI_OPS) + "), all, or OP,OP,...")
    p.add_argument("--proto", type=int, default=7, help="upstream peer's major version (default 7)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per test-backend-ops run and per replay")
    p.add_argument("--max-capture-gb", type=float, default=MAX_CAPTURE / 1e9,
                   help="recordings larger than this are not replayed (default %(default)g)")
    p.add_argument("--params", metavar="REGEX", default=None,
                   help="only the cases whose parameters match REGEX (test-backend-ops -p), recorded as 'OP [REGEX]'")
    p.add_argument("--record", action="store_true", help="merge the result into op_closeness.json")
    p.add_argument("--json", metavar="FILE", help="also write this run's result here")
    args = p.parse_args(argv)
    peer = peer_for(args.proto)
    if not peer.installed():
        print(f"error: upstream {peer.version} is not installed: run `ggml-rpc upstream install`", file=sys.stderr)
        return 2
    ops = ops_from_option(None if args.ops in (None, "CI") else args.ops)
    result = measure(peer, ops, args.timeout, int(args.max_capture_gb * 1e9), args.params)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.record:
        CLOSENESS_FILE.write_text(json.dumps(merge(load(), result), indent=1) + "\n", encoding="utf-8")
    print("\n".join(section(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
