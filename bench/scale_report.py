"""Figures and tables of ``bench/bench_scale.py``: pure functions over the runs it recorded (no process, no file)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

GB = 1e9

#: Keys of a measured run that are its measurement rather than what the command found.
_MEASURED = {"seconds", "peak_kib", "rc", "timed_out", "stderr"}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` when both are known and ``b`` is not zero (above 1: ``a`` is faster), else None."""
    return a / b if a is not None and b else None


def summarise_runs(runs: Sequence[dict[str, Any]], size_bytes: int) -> dict[str, Any]:
    """One command's runs on a capture of ``size_bytes``: median time of the runs that ended, GB/s of capture at that
    time, the highest peak RSS of any run, and what the last run that ended found (violations, mismatches...)."""
    ended = [r for r in runs if not r.get("timed_out")]
    seconds = [float(r["seconds"]) for r in ended]
    median = statistics.median(seconds) if seconds else None
    found = {k: v for k, v in (ended[-1] if ended else {}).items() if k not in _MEASURED}
    return {"runs": list(runs), "seconds": median, "min_seconds": min(seconds) if seconds else None,
            "gb_per_s": size_bytes / median / GB if median else None,
            "peak_kib": max((int(r["peak_kib"]) for r in runs), default=None),
            "rcs": sorted({r["rc"] for r in runs}, key=lambda rc: (rc is None, rc)),
            "timed_out": sum(1 for r in runs if r.get("timed_out")), **found}


def _median(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarise_side(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One server's generation runs: median prompt and generation tokens/s of the runs that ended well, peak RSS."""
    ok = [r for r in runs if r.get("rc") == 0]
    return {"runs": list(runs), "completed": len(ok), "timed_out": sum(1 for r in runs if r.get("timed_out")),
            "prompt_tps": _median(ok, "prompt_tps"), "eval_tps": _median(ok, "eval_tps"),
            "prompt_tokens": ok[-1].get("prompt_tokens") if ok else None,
            "peak_kib": max((int(r["server_peak_kib"]) for r in runs if r.get("server_peak_kib")), default=None)}


def summarise_generation(sides: dict[str, Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """Both servers' generation runs: each side's summary, the reference/upstream ratios and whether every run that
    ended well printed the same text (None when either side has no such run)."""
    ref, up = summarise_side(sides["reference"]), summarise_side(sides["upstream"])
    texts = {r["text"] for runs in sides.values() for r in runs if r.get("rc") == 0}
    same = len(texts) == 1 if ref["completed"] and up["completed"] else None
    return {"reference": ref, "upstream": up, "ratio_prompt": ratio(ref["prompt_tps"], up["prompt_tps"]),
            "ratio_eval": ratio(ref["eval_tps"], up["eval_tps"]), "same_text": same}


# ---- Markdown ---------------------------------------------------------------------------------------------------


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:,.1f} s" if seconds < 100 else f"{seconds:,.0f} s"


def _mib(kib: int | None) -> str:
    return "—" if kib is None else f"{kib / 1024:,.0f} MiB"


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    return (f"{x:.2f}" if x < 10 else f"{x:,.1f}" if x < 100 else f"{x:,.0f}") + unit


def _tool_result(name: str, t: dict[str, Any]) -> str:
    state = f"{t['timed_out']} timed out; " if t.get("timed_out") else ""
    if name == "lint":
        return state + f"{t.get('violations', '?')} violations"
    if name == "replay":
        nmse = t.get("worst_nmse")
        return state + (f"{t.get('requests', '?'):,} requests, {t.get('mismatches', '?')} mismatches, worst NMSE "
                        f"{nmse:.1e}" if nmse is not None else "no report")
    return state + f"exit {', '.join(str(rc) for rc in t.get('rcs', []))}"


def size_table(entry: dict[str, Any]) -> str:
    """The Markdown table of one size: session, tools, anchor, generation."""
    session, tools, gen = entry.get("session"), entry.get("tools") or {}, entry.get("generation")
    lines = ["| step | time | GB/s | peak RSS | result |", "|---|---|---|---|---|"]
    if session:
        proxy = session["proxy"]
        client = session["client"]
        state = ("client timed out; " if client["timed_out"] else "" if client["rc"] == 0
                 else f"client: {client['why']}; ")
        lines.append(f"| session: upstream client → `proxy --check --pcap` → upstream server | {_s(client['seconds'])} "
                     f"| — "
                     f"| proxy {_mib(proxy['peak_kib'])}; upstream server {_mib(session['upstream_server_peak_kib'])} "
                     f"| {state}capture {session['pcap_bytes'] / GB:.2f} GB, {proxy['violations']} violations |")
    names = {"decode": "`ggml-rpc decode`", "lint": "`ggml-rpc lint`", "replay": "`ggml-rpc replay` (reference)",
             "tshark": "`tshark -r FILE -q -z io,stat,0` (anchor)"}
    for name, label in names.items():
        if name in tools:
            t = tools[name]
            extra = f" (target {_mib(t['target_peak_kib'])})" if t.get("target_peak_kib") else ""
            lines.append(f"| {label} | {_s(t['seconds'])} | {_num(t['gb_per_s'])} | {_mib(t['peak_kib'])}{extra} "
                         f"| {_tool_result(name, t)} |")
    if gen:
        for what, key in (("prompt", "prompt_tps"), ("generation", "eval_tps")):
            ref, up = gen["reference"][key], gen["upstream"][key]
            lines.append(f"| {what} tok/s, reference / upstream | | | | {_num(ref)} / {_num(up)} "
                         f"(ratio {_num(ratio(ref, up), 'x')}) |")
        same = {True: "same text", False: "**texts differ**", None: "text not compared"}[gen["same_text"]]
        timeouts = [f"{side} {gen[side]['timed_out']} of {len(gen[side]['runs'])} runs timed out (limit "
                    f"{gen['timeout']:.0f} s)" for side in ("reference", "upstream") if gen[side]["timed_out"]]
        lines.append(f"| generation server peak RSS, reference / upstream | | | {_mib(gen['reference']['peak_kib'])} "
                     f"/ {_mib(gen['upstream']['peak_kib'])} | {'; '.join([same, *timeouts])} |")
    return "\n".join(lines)


def markdown(record: dict[str, Any]) -> str:
    """Every size of a record as a heading and its table."""
    out = []
    for entry in record.get("sizes", []):
        m = entry["model"]
        shape = m["shape"]
        out.append(f"**{m['name']}** ({shape['ftype']}, n_embd {shape['n_embd']}, {shape['n_layer']} layers, "
                   f"{shape['n_head']}/{shape['n_head_kv']} heads, n_ff {shape['n_ff']}; model file "
                   f"{m['bytes'] / GB:.2f} GB; {entry['n_predict']} tokens generated, {entry['rounds']} round(s))\n")
        out.append(size_table(entry) + "\n")
    return "\n".join(out)
