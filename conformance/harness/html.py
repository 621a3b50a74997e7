"""The HTML report of a conformance run (``ggml-rpc check --html DIR``): static, self-contained, no JavaScript.

``DIR/index.html`` opens with the run's verdict line (the one of :mod:`.verdict`, as every format shows it), then
the failures (ID, level, one-line reason, the death's signal), a setup error naming its cause when checks were
blocked, a legend of the labels, the date, the kit's version and the target; then every check by category with its
level, outcome (pass green, fail red, a death dark red, a failed SHOULD rule orange, blocked yellow, skip and
unsupported grey), duration and links.  ``DIR/checks/<ID>.html`` holds the requirement and its spec section
(linked into ``DIR/protocol.html``, the spec rendered), the outcome, a death with its signal and step, the evidence
as sent / expected / got (cells wrap; the failing step is marked), and every message of the check's exchange
decoded by the spec (command, fields, sizes) with its bytes below; it links the check's pcap when one was written.
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from ggml_rpc.spec.codec import REPLY_HEADER_SIZE, REQUEST_HEADER_SIZE

from ..sessions.decode import describe
from .model import Outcome, Result, iter_groups
from .verdict import LEGEND, STATE_MEANING, State, Verdict, died, kind, label, reason

#: Bytes of a message shown as hex on its check's page (the pcap has them all).
HEX_LIMIT = 512

CSS = """\
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 80em; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; width: 100%; margin: .5em 0; table-layout: auto; }
th, td { border: 1px solid #ccc; padding: .25em .5em; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; word-break: break-word; }
th { background: #f3f3f3; }
td.outcome { font-weight: bold; text-align: center; white-space: nowrap; }
td.level { white-space: nowrap; overflow-wrap: normal; word-break: normal; }
tr > td:first-child { white-space: nowrap; }
.pass { background: #0a0; color: #fff; } .fail { background: #d00; color: #fff; }
.fail-should { background: #f90; color: #000; } .died { background: #600; color: #fff; }
.error { background: #700; color: #fff; } .blocked { background: #fd0; color: #000; }
.skip, .not-run { background: #ccc; color: #000; } .unsupported { background: #9bd; color: #000; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: .5em; margin: .2em 0 .8em;
      white-space: pre-wrap; overflow-wrap: anywhere; word-break: break-all; }
table.evidence td:nth-child(n+2) { width: 28%; }
tr.failing-step > td { background: #fee; } tr.failing-step > td:first-child { border-left: 4px solid #d00; }
.mark { color: #d00; font-weight: bold; }
.verdict { font-size: 1.25em; font-weight: bold; padding: .5em .8em; margin: .5em 0; border-radius: 4px; }
.verdict.conformant { background: #0a0; color: #fff; } .verdict.not-conformant { background: #d00; color: #fff; }
.verdict.not-covered, .verdict.incomplete { background: #fd0; color: #000; }
.dir { white-space: nowrap; font-family: monospace; } .note { color: #555; }
dl.meta dt { font-weight: bold; float: left; clear: left; width: 11em; } dl.meta dd { margin-left: 12em; }
"""


def outcome_class(r: Result) -> tuple[str, str]:
    """(css class, label) of a result, labelled as every format labels it (:func:`.verdict.label`)."""
    k = kind(r)
    if k == "fail" and r.failed_level is not None and r.failed_level.value == "SHOULD":
        return "fail-should", label(r)
    return k.replace(" ", "-"), label(r)


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)




def _page(title: str, body: str, css_href: str | None) -> str:
    style = (f'<link rel="stylesheet" href="{escape(css_href)}">' if css_href is not None
             else f"<style>\n{CSS}</style>")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"{style}\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def standalone_page(title: str, body: str) -> str:
    """A page of one file (its CSS inline), for reports that are a single page or sit anywhere on disk."""
    return _page(title, body, None)


def _rel(path: str | Path, start: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), start.resolve())).as_posix()


def page_name(check_id: str) -> str:
    return f"checks/{check_id}.html"


def _spec_href(spec: str) -> str | None:
    """``spec/PROTOCOL.md#v7-hello`` -> ``../protocol.html#v7-hello``."""
    if "#" not in spec:
        return None
    return "../protocol.html#" + spec.split("#", 1)[1]


def _hex(data: bytes) -> str:
    shown = data[:HEX_LIMIT]
    lines = [f"{i:06x}  {shown[i:i + 16].hex(' ')}" for i in range(0, len(shown), 16)]
    if len(data) > HEX_LIMIT:
        lines.append(f"… {len(data) - HEX_LIMIT:,} more bytes (all of them in the pcap)")
    return "\n".join(lines) or "(no bytes)"


def _messages(r: Result, protocol: Any) -> str:
    """The check's exchange, every message decoded by the spec with its bytes."""
    rec = r.recording
    if rec is None or not rec.connections:
        return '<p class="note">No connection of this check was recorded (it opened none through the harness).</p>'
    parts = []
    for conn, dc in rec.decoded(protocol):
        c2s, s2c = conn.stream(True), conn.stream(False)
        parts.append(f"<h3>Connection {conn.index + 1}: {escape(conn.client[0])}:{conn.client[1]} → "
                     f"{escape(conn.server[0])}:{conn.server[1]} ({len(c2s):,} bytes sent, {len(s2c):,} received)</h3>")
        if conn.dropped:
            parts.append(f'<p class="note">{conn.dropped:,} further bytes were not kept (recording budget).</p>')
        rows, end = [], {True: 0, False: 0}
        for msg in dc.messages():
            from_client = msg in dc.requests
            stream = c2s if from_client else s2c
            head = REQUEST_HEADER_SIZE if from_client else REPLY_HEADER_SIZE
            raw = stream[msg.offset: msg.offset + head + msg.size]
            end[from_client] = max(end[from_client], msg.offset + head + msg.size)
            arrow = "client → server" if from_client else "server → client"
            rows.append(f'<tr><td class="dir">{arrow}</td><td>{escape(describe(msg))}</td><td>{msg.size:,}</td>'
                        f"<td><pre>{escape(_hex(raw))}</pre></td></tr>")
        parts.append("<table><tr><th>direction</th><th>message (decoded by the spec)</th><th>payload bytes</th>"
                     "<th>bytes</th></tr>" + "".join(rows) + "</table>")
        if dc.error is not None:
            parts.append(f"<p><b>Not decodable ({escape(dc.error_direction)}):</b> {escape(dc.error)}</p>")
        for from_client, stream in ((True, c2s), (False, s2c)):
            rest = stream[end[from_client]:]
            if rest:
                who = "client" if from_client else "server"
                parts.append(f"<p>Bytes the {who} sent after the last decoded message:</p>"
                             f"<pre>{escape(_hex(rest))}</pre>")
        for note in dc.notes:
            parts.append(f'<p class="note">{escape(note)}</p>')
    return "\n".join(parts)


def _check_page(r: Result, protocol: Any, page_dir: Path) -> str:
    c = r.check
    cls, label = outcome_class(r)
    spec = _spec_href(r.spec)
    spec_html = f'<a href="{escape(spec)}">{escape(r.spec)}</a>' if spec else escape(r.spec or "-")
    body = ['<p><a href="../index.html">← all checks</a></p>', f"<h1>{escape(c.id)}: {escape(c.title)}</h1>",
            '<dl class="meta">', f"<dt>requirement</dt><dd>{escape(c.title)}</dd>",
            f"<dt>level</dt><dd>{escape(c.level.value)}</dd>", f"<dt>category</dt><dd>{escape(c.category.value)}</dd>",
            f"<dt>versions</dt><dd>{escape(c.versions_label)}</dd>", f"<dt>spec section</dt><dd>{spec_html}</dd>",
            f'<dt>outcome</dt><dd><span class="{cls}">&nbsp;{escape(label)}&nbsp;</span> {escape(r.message)}</dd>',
            f"<dt>duration</dt><dd>{r.duration * 1000:.1f} ms</dd>"]
    if r.pcap:
        body.append(f'<dt>pcap</dt><dd><a href="{escape(_rel(r.pcap, page_dir))}">{escape(Path(r.pcap).name)}</a> '
                    "(<code>ggml-rpc replay</code> re-runs it; Wireshark with the kit's dissector shows it)</dd>")
    body.append("</dl>")
    if r.server_death:
        d = r.server_death
        body.append("<h2>Server death</h2><dl class=\"meta\">")
        for key in ("status", "step", "restart", "note"):
            if d.get(key):
                body.append(f"<dt>{escape(key)}</dt><dd>{escape(d[key])}</dd>")
        body.append("</dl>")
        if d.get("sent"):
            body.append(f"<p>Bytes the step sent:</p><pre>{escape(d['sent'])}</pre>")
        if d.get("log_tail"):
            body.append("<p>Last lines of the server's log:</p><pre>" + escape("\n".join(d["log_tail"])) + "</pre>")
    if r.evidence:
        failing = _failing_steps(r)
        body.append('<h2>Evidence</h2><table class="evidence"><tr><th>step</th><th>sent</th><th>expected</th>'
                    "<th>got</th></tr>")
        for i, ev in enumerate(r.evidence):
            cells = "".join(f"<td><pre>{escape(v)}</pre></td>" if v else "<td></td>"
                            for v in (ev.sent, ev.expected, ev.got))
            if i in failing:
                body.append(f'<tr class="failing-step"><td><span class="mark">✗ {escape(failing[i])}:</span> '
                            f"{escape(ev.step)}</td>{cells}</tr>")
            else:
                body.append(f"<tr><td>{escape(ev.step)}</td>{cells}</tr>")
        body.append("</table>")
    body.append("<h2>Exchange</h2>")
    body.append(_messages(r, protocol))
    return _page(f"{c.id}: {c.title}", "\n".join(body), "../style.css")


def _failing_steps(r: Result) -> dict[int, str]:
    """Which evidence rows to mark (index -> why): the step the check failed at (its last evidence: the runner
    appends the failure's own), and for a death the step during which the server died."""
    if not (r.failed or r.outcome is Outcome.BLOCKED) or not r.evidence:
        return {}
    marks: dict[int, str] = {}
    if died(r) and r.server_death and r.server_death.get("step"):
        step = r.server_death["step"]
        for i in range(len(r.evidence) - 1, -1, -1):
            if r.evidence[i].step == step:
                marks[i] = "the server died during this step"
                break
    last = len(r.evidence) - 1
    marks.setdefault(last, "failing step" if r.outcome is not Outcome.BLOCKED else "setup refused here")
    return marks


def _protocol_page() -> str:
    """spec/PROTOCOL.md rendered (its ``<a id>`` anchors are the sections checks link to)."""
    import markdown

    text = resources.files("ggml_rpc.spec").joinpath("PROTOCOL.md").read_text(encoding="utf-8")
    body = markdown.markdown(text, extensions=["tables", "fenced_code"], output_format="html")
    return _page("ggml RPC protocol", '<p><a href="index.html">← report</a></p>\n' + body, "style.css")


def _verdict_block(verdict: Verdict, results: Sequence[Result]) -> list[str]:
    """The first screen of the index: the verdict line, then what made it (failures, setup errors)."""
    cls = verdict.state.value.replace(" ", "-")
    out = [f'<div class="verdict {cls}" id="verdict">{escape(verdict.line())}</div>',
           f'<p class="note">{escape(STATE_MEANING[verdict.state])} (exit code {verdict.exit_code})</p>']
    if verdict.profile is not None:
        p = verdict.profile
        out.append(f'<p class="note"><b>A partial run, not full conformance:</b> the {escape(p.name)} profile '
                   f"({escape(p.meaning)}); {p.left_out} checks of the selection left out.</p>")
    for cause, n in verdict.setup_refusals:
        out.append(f"<p><b>Setup error:</b> the server refused the harness's own setup: {escape(cause)} — {n} "
                   f"check{'s' * (n != 1)} blocked (their rules never ran).</p>")
    if verdict.failures:
        out.append('<h2 id="failures">Failures</h2><table><tr><th>ID</th><th>level</th><th>outcome</th>'
                   "<th>reason</th><th>death</th></tr>")
        for r in verdict.failures:
            cls_r, lab = outcome_class(r)
            death = escape(r.server_death.get("status", "")) if died(r) and r.server_death else ""
            out.append(f'<tr><td><a href="{escape(page_name(r.check.id))}">{escape(r.check.id)}</a></td>'
                       f'<td class="level">{escape((r.failed_level or r.check.level).value)}</td>'
                       f'<td class="outcome {cls_r}">{escape(lab)}</td><td>{escape(reason(r))}</td>'
                       f"<td>{death}</td></tr>")
        out.append("</table>")
    if verdict.state is State.NOT_COVERED:
        out.append(f"<p>The server {escape(verdict.server.removeprefix('speaks '))}: only the handshake checks "
                   "could judge it.</p>")
    legend = "".join(f'<tr><td class="outcome {k.replace(" ", "-")}">{escape(k)}</td><td>{escape(v)}</td></tr>'
                     for k, v in LEGEND)
    out.append(f'<details open><summary>Legend</summary><table>{legend}</table></details>')
    return out


def write_html_report(out_dir: str | Path, results: Sequence[Result], server: Iterable[tuple[str, str]],
                      protocol: Any, summary: dict[str, int], *, title: str = "ggml RPC conformance report",
                      verdict: Verdict | None = None) -> Path:
    """Write the report into ``out_dir``; sets each result's ``html`` to its page and returns index.html.

    ``server`` is the (label, value) rows of the header (target, address, version, date, kit version...);
    ``verdict`` the run's verdict, shown first."""
    out = Path(out_dir)
    (out / "checks").mkdir(parents=True, exist_ok=True)
    (out / "style.css").write_text(CSS, encoding="utf-8")
    (out / "protocol.html").write_text(_protocol_page(), encoding="utf-8")
    for r in results:
        page = out / page_name(r.check.id)
        r.html = str(page)
        page.write_text(_check_page(r, protocol, page.parent), encoding="utf-8")
    rows = ["".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in server)]
    words = {"must_failures": "MUST failures", "should_failures": "SHOULD failures", "total": "checks"}
    counts = ", ".join(f"{v} {words.get(k, k)}" for k, v in summary.items() if v)
    body = [f"<h1>{escape(title)}</h1>"]
    if verdict is not None:
        body.extend(_verdict_block(verdict, results))
    body += ["<table>" + "".join(rows) + f"<tr><th>results</th><td>{escape(counts)}</td></tr></table>",
             '<p><a href="protocol.html">The protocol specification</a></p>']
    for category, group in iter_groups(results):
        body.append(f'<h2 id="{escape(category.value)}">{escape(category.value)}</h2>')
        body.append("<table><tr><th>ID</th><th>check</th><th>level</th><th>outcome</th><th>duration</th>"
                    "<th>pcap</th></tr>")
        for r in group:
            cls, lab = outcome_class(r)
            pcap = f'<a href="{escape(_rel(r.pcap, out))}">pcap</a>' if r.pcap else ""
            body.append(f'<tr id="{escape(r.check.id)}"><td><a href="{escape(page_name(r.check.id))}">'
                        f"{escape(r.check.id)}</a>"
                        f'</td><td>{escape(r.check.title)}</td><td class="level">{escape(r.check.level.value)}</td>'
                        f'<td class="outcome {cls}">{escape(lab)}</td><td>{r.duration * 1000:.1f} ms</td>'
                        f"<td>{pcap}</td></tr>")
        body.append("</table>")
    index = out / "index.html"
    index.write_text(_page(title, "\n".join(body), "style.css"), encoding="utf-8")
    return index
