"""``ggml-rpc fuzz --html DIR``: the campaign's findings as a static page, one row per finding class, and a page per
class with its reproducer's messages decoded by the spec (from the pcap ``ggml-rpc replay`` re-runs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..harness.html import HEX_LIMIT, escape
from ..harness.html import standalone_page as _page
from ..sessions.decode import decode_file, describe

#: Finding kinds as the check report colours outcomes: deaths and leaks red, the rest orange.
_CLASS = {"crash": "fail", "info-leak": "fail", "out-of-buffer": "fail", "hang": "non-strict",
          "wrong-reply": "non-strict"}


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)[:120]


def _reproducer_rows(pcap: Path) -> str:
    try:
        decoded = decode_file(pcap)
    except Exception as exc:  # a reproducer the decoder cannot read is shown as such, not hidden
        return f"<p>The reproducer cannot be decoded: {escape(exc)}</p>"
    parts = []
    for dc in decoded:
        rows = []
        for msg in dc.messages():
            arrow = "client → server" if msg in dc.requests else "server → client"
            rows.append(f'<tr><td class="dir">{arrow}</td><td>{escape(describe(msg))}</td><td>{msg.size:,}</td></tr>')
        parts.append(f"<h3>Connection {dc.conn.index + 1}</h3><table><tr><th>direction</th><th>message (decoded by "
                     "the spec)</th><th>payload bytes</th></tr>" + "".join(rows) + "</table>")
        if dc.error is not None:
            parts.append(f"<p><b>Not decodable ({escape(dc.error_direction)}):</b> {escape(dc.error)}</p>")
    return "\n".join(parts) or "<p>The reproducer holds no connection.</p>"


def write_findings_html(report: dict[str, Any], out_dir: str | Path) -> Path:
    """``out_dir/index.html`` (and a page per class) from a campaign's ``findings.json`` content."""
    out = Path(out_dir)
    (out / "findings").mkdir(parents=True, exist_ok=True)
    summary = [(k, report[k]) for k in ("target", "protocol", "seed", "examples", "messages", "seconds",
                                        "messages_per_second", "restarts") if k in report]
    classes = report.get("classes", [])
    body = ["<h1>ggml RPC fuzz findings</h1>", "<table>"]
    body += [f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in summary]
    body.append(f"<tr><th>finding classes</th><td>{len(classes)}</td></tr></table>")
    body.append("<table><tr><th>class</th><th>kind</th><th>symptom</th><th>command</th><th>rule broken</th>"
                "<th>first hit</th><th>verified</th><th>reproducer</th></tr>")
    for c in classes:
        name = _slug(c.get("class") or c.get("kind", "finding"))
        page = out / "findings" / f"{name}.html"
        pcap = Path(c["reproducer"]) if c.get("reproducer") else None
        link = ""
        if pcap is not None and pcap.exists():
            link = f'<a href="{escape(Path(os.path.relpath(pcap.resolve(), out.resolve())).as_posix())}">pcap</a>'
        detail = ['<p><a href="../index.html">← all findings</a></p>', f"<h1>{escape(c.get('class'))}</h1>",
                  f"<p>{escape(c.get('message', ''))}</p>"]
        if c.get("death"):
            detail.append("<h2>Death</h2><pre>" + escape(c["death"].get("status", "")) + "\n"
                          + escape("\n".join(c["death"].get("log_tail") or [])) + "</pre>")
        if pcap is not None and pcap.exists():
            rel = Path(os.path.relpath(pcap.resolve(), page.parent.resolve())).as_posix()
            detail.append(f'<p>Reproducer: <a href="{escape(rel)}">{escape(pcap.name)}</a> '
                          f"({pcap.stat().st_size:,} bytes; "
                          f"<code>ggml-rpc replay {escape(pcap.name)} --server HOST:PORT</code> re-runs it; at most "
                          f"{HEX_LIMIT} bytes of a message are ever shown in the check report, all are here)</p>")
            detail.append(_reproducer_rows(pcap))
        for note in c.get("notes") or []:
            detail.append(f'<p class="note">{escape(note)}</p>')
        page.write_text(_page(str(c.get("class")), "\n".join(detail)), encoding="utf-8")
        cls = _CLASS.get(c.get("kind", ""), "skip")
        first = c.get("first_seconds")
        body.append(f'<tr id="{escape(name)}"><td><a href="findings/{escape(name)}.html">'
                    f'{escape(c.get("class"))}</a></td>'
                    f'<td class="outcome {cls}">{escape(c.get("kind"))}</td><td>{escape(c.get("symptom") or "")}</td>'
                    f"<td>{escape(c.get('command') or '')}</td><td>{escape(c.get('rule') or '')}</td>"
                    f"<td>{'' if first is None else f'{first:.1f} s'}</td><td>{escape(c.get('verified'))}</td>"
                    f"<td>{link}</td></tr>")
    body.append("</table>")
    if not classes:
        body.append("<p>Nothing was found.</p>")
    index = out / "index.html"
    index.write_text(_page("ggml RPC fuzz findings", "\n".join(body)), encoding="utf-8")
    return index
