"""The HTML report of a conformance run (``ggml-rpc check --html DIR``): static, self-contained, no JavaScript.

``DIR/index.html`` names the server (address, announced version, verdict) and lists every check by category with
its level, outcome (coloured as Autobahn|Testsuite colours them: pass green, fail red, a SHOULD failure orange as
"non-strict", skip and unsupported grey), duration and links; ``DIR/checks/<ID>.html`` holds the requirement and
its spec section (linked into ``DIR/protocol.html``, the spec rendered), the outcome, a death with its signal and
step, the evidence as sent / expected / got, and every message of the check's exchange decoded by the spec
(command, fields, sizes) with its bytes below; it links the check's pcap when one was written.
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from ggml_rpc.spec.codec import REPLY_HEADER_SIZE, REQUEST_HEADER_SIZE

from .model import Level, Outcome, Result, iter_groups

#: Bytes of a message shown as hex on its check's page (the pcap has them all).
HEX_LIMIT = 512

CSS = """\
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 80em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; width: 100%; margin: .5em 0; }
th, td { border: 1px solid #ccc; padding: .25em .5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.outcome { font-weight: bold; text-align: center; white-space: nowrap; }
tr > td:first-child { white-space: nowrap; }
.pass { background: #0a0; color: #fff; } .fail { background: #d00; color: #fff; }
.non-strict { background: #f90; color: #000; } .error { background: #700; color: #fff; }
.skip, .not-run { background: #ccc; color: #000; } .unsupported { background: #9bd; color: #000; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: .5em; overflow-x: auto; white-space: pre;
      margin: .2em 0 .8em; }
.dir { white-space: nowrap; font-family: monospace; } .note { color: #555; }
dl.meta dt { font-weight: bold; float: left; clear: left; width: 11em; } dl.meta dd { margin-left: 12em; }
"""


def outcome_class(r: Result) -> tuple[str, str]:
    """(css class, label) of a result: a failed SHOULD rule is "non-strict", as Autobahn calls it."""
    if r.outcome is Outcome.FAIL and r.failed_level is Level.SHOULD:
        return "non-strict", "non-strict"
    return r.outcome.value.replace(" ", "-"), r.outcome.value


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
    from ..sessions.decode import describe

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
        body.append("<h2>Evidence</h2><table><tr><th>step</th><th>sent</th><th>expected</th><th>got</th></tr>")
        for ev in r.evidence:
            cells = "".join(f"<td><pre>{escape(v)}</pre></td>" if v else "<td></td>"
                            for v in (ev.sent, ev.expected, ev.got))
            body.append(f"<tr><td>{escape(ev.step)}</td>{cells}</tr>")
        body.append("</table>")
    body.append("<h2>Exchange</h2>")
    body.append(_messages(r, protocol))
    return _page(f"{c.id}: {c.title}", "\n".join(body), "../style.css")


def _protocol_page() -> str:
    """spec/PROTOCOL.md rendered (its ``<a id>`` anchors are the sections checks link to)."""
    import markdown

    text = resources.files("ggml_rpc.spec").joinpath("PROTOCOL.md").read_text(encoding="utf-8")
    body = markdown.markdown(text, extensions=["tables", "fenced_code"], output_format="html")
    return _page("ggml RPC protocol", '<p><a href="index.html">← report</a></p>\n' + body, "style.css")


def write_html_report(out_dir: str | Path, results: Sequence[Result], server: Iterable[tuple[str, str]],
                      protocol: Any, summary: dict[str, int], *, title: str = "ggml RPC conformance report") -> Path:
    """Write the report into ``out_dir``; sets each result's ``html`` to its page and returns index.html."""
    out = Path(out_dir)
    (out / "checks").mkdir(parents=True, exist_ok=True)
    (out / "style.css").write_text(CSS, encoding="utf-8")
    (out / "protocol.html").write_text(_protocol_page(), encoding="utf-8")
    for r in results:
        page = out / page_name(r.check.id)
        r.html = str(page)
        page.write_text(_check_page(r, protocol, page.parent), encoding="utf-8")
    rows = ["".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in server)]
    counts = ", ".join(f"{v} {k}" for k, v in summary.items() if v)
    body = [f"<h1>{escape(title)}</h1>",
            "<table>" + "".join(rows) + f"<tr><th>results</th><td>{escape(counts)}</td></tr></table>",
            '<p><a href="protocol.html">The protocol specification</a></p>']
    for category, group in iter_groups(results):
        body.append(f'<h2 id="{escape(category.value)}">{escape(category.value)}</h2>')
        body.append("<table><tr><th>ID</th><th>check</th><th>level</th><th>outcome</th><th>duration</th>"
                    "<th>pcap</th></tr>")
        for r in group:
            cls, label = outcome_class(r)
            pcap = f'<a href="{escape(_rel(r.pcap, out))}">pcap</a>' if r.pcap else ""
            body.append(f'<tr id="{escape(r.check.id)}"><td><a href="{escape(page_name(r.check.id))}">'
                        f"{escape(r.check.id)}</a>"
                        f"</td><td>{escape(r.check.title)}</td><td>{escape(r.check.level.value)}</td>"
                        f'<td class="outcome {cls}">{escape(label)}</td><td>{r.duration * 1000:.1f} ms</td>'
                        f"<td>{pcap}</td></tr>")
        body.append("</table>")
    index = out / "index.html"
    index.write_text(_page(title, "\n".join(body), "style.css"), encoding="utf-8")
    return index
