"""The check catalogue as Markdown, generated from :data:`~ggml_rpc.conformance.checks.CATALOGUE`.

The counts and ID ranges were typed by hand and went stale with every release that added checks (103 checks and
``FRAME-…035`` when there were 122 and ``FRAME-047``).  They now come from the catalogue: the documentation site's
catalogue page is :func:`page`'s output, rendered at every build (the site's hook), so no copy of it is stored.
Only the one-line summaries of what each category enforces are prose, kept here beside the figures they describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ggml_rpc.conformance.harness import SPEC_DOC, Category, Check

#: What each category enforces (prose; the figures beside it are computed).
ENFORCES: dict[str, str] = {
    "handshake": "HELLO reply of 28 bytes, covered version (and the one expected), pad 0, zero caps over TCP, same "
    "version on every connection; a non-HELLO first command, a HELLO of the wrong size and a second HELLO close "
    "without a reply; at least one device",
    "framing": "one check per validation rule of the protocol (unknown ids, NONE, wrong fixed sizes, devices out "
    "of range, unknown handles, invalid and removed types, tensors outside their buffer or wrapping, "
    "SET/GET/MEMSET/COPY past the region or the tensor, GRAPH_COMPUTE truncations, unknown/null nodes, dangling "
    "sources, data without buffer, huge size claims, cache hits that do not fit, a SET_TENSOR in the other "
    "version's layout; 8.0.0: 2-D rows of size 0, past the tensor or overflowing, GRAPH_RECOMPUTE of an unknown or "
    "freed uid) and upstream's memory-safety bug classes (partial quantisation blocks, empty and wrapping sizes, views "
    "past their source, null and foreign buffers in graphs, cycles, out-of-range GET_ROWS/SET_ROWS/SSM_SCAN indices "
    "and ACC/SET/GATED_DELTA_NET op_params judged by canaries around the tensors, CUSTOM ops' function pointers). "
    "MUST: the connection closes where the spec says and no reply carries a byte; SHOULD: the server "
    "still accepts connections afterwards (upstream 6.0/7.0 builds die on several of these)",
    "data": "buffers (handles, sizes, base stable and aligned, size 0, FREE), alignment, max size, device memory, "
    "round trips at offset 0, 1, unaligned addresses and a whole 1 MiB buffer, MEMSET_TENSOR, BUFFER_CLEAR, "
    "COPY_TENSOR, GET_ALLOC_SIZE ≥ nbytes, INIT_TENSOR, hash misses, GET_DEVICE_SUPPORTS_OP (7.0.1), an allocation "
    "the device cannot satisfy answered in band (`remote_ptr` 0), commands that send no reply at all, a fresh "
    "buffer that hands out no other allocation's bytes; 8.0.0: SET_TENSOR_2D / GET_TENSOR_2D rows",
    "cache-v6": "the version's cache rule, black-box through SET_TENSOR_HASH (v6: > 10 MiB saved, exactly 10 MiB "
    "and small payloads not; v7: any non-zero flag saves at any size, unflagged never, even > 10 MiB; a hit fills "
    "identical bytes at the requested offset, on a later connection too), white-box with `--cache-dir` (file named "
    "by the FNV-1a hex holding the raw payload, no stray files). Without an observable cache they skip, saying so",
    "isolation": "buffer handles of a closed or of another live connection are refused (the live case is skipped on "
    "servers that serve one connection at a time, as upstream does)",
    "compute": "one small graph per op family (binary, math, UNARY activations, MUL_MAT f32/f16 and Q8_0, norms, "
    "SOFT_MAX plain and masked, ROPE, GET_ROWS, CONT/CPY, GLU, reductions, REPEAT/CONCAT, GRAPH_RECOMPUTE; 8.0.0: "
    "GRAPH_RECOMPUTE by uid) compared with the reference executor by normalised mean squared error (1e-7 exact ops, "
    "1e-5 transcendental, 5e-4 MUL_MAT), inputs drawn from the run's `--seed`; an op the server declines (closes on) "
    "is unsupported",
    "comm": "8.0.0's communicator: COMM_INIT for other than two ranks and COMM_ALLREDUCE without a communicator are "
    "refused, COMM_ALLREDUCE sums the tensor across two servers over their own link",
}
#: Categories shown in one row (the cache rules of two versions share one summary).
_MERGED = {"cache-v7": "cache-v6"}


@dataclass(frozen=True)
class CategoryRow:
    categories: tuple[str, ...]
    count: int
    ids: str  # the ranges, e.g. "`FRAME-001…047`"
    enforces: str


def _range(ids: Sequence[str]) -> str:
    """``PREFIX-001…NNN`` for IDs numbered 1..N without a gap; otherwise every ID (a gap must show)."""
    prefix, _, _ = ids[0].rpartition("-")
    numbers = [int(i.rpartition("-")[2]) for i in ids]
    if all(i.rpartition("-")[0] == prefix for i in ids) and numbers == list(range(numbers[0], numbers[-1] + 1)):
        width = len(ids[0].rpartition("-")[2])
        return f"`{ids[0]}…{numbers[-1]:0{width}d}`" if len(ids) > 1 else f"`{ids[0]}`"
    return ", ".join(f"`{i}`" for i in ids)


def rows(catalogue: Sequence[Check]) -> list[CategoryRow]:
    """One row per category (in run order), merged where :data:`_MERGED` says."""
    ids: dict[str, list[str]] = {}
    for c in catalogue:
        ids.setdefault(c.category.value, []).append(c.id)
    out: list[CategoryRow] = []
    for cat in Category:
        name = cat.value
        if name not in ids or name in _MERGED:
            continue
        group = [name, *(k for k, v in _MERGED.items() if v == name and k in ids)]
        out.append(CategoryRow(tuple(group), sum(len(ids[g]) for g in group), ", ".join(_range(ids[g]) for g in group),
                       ENFORCES[name]))
    return out


def table(catalogue: Sequence[Check]) -> str:
    """The total and one row per category: count, ID ranges, what it enforces."""
    lines = [f"{len(catalogue)} checks in {len(rows(catalogue))} groups:", "",
             "| category | checks | IDs | what it enforces |", "|---|---|---|---|"]
    lines += [f"| {', '.join(r.categories)} | {r.count} | {r.ids} | {r.enforces} |" for r in rows(catalogue)]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


#: Where the rule table is (a check's rules link there).
RULES_ANCHOR = f"{SPEC_DOC}#rules"


def _rules(check: Check) -> str:
    """The check's rules of the table, each linked to it; a dash for a check of something the table does not state."""
    return ", ".join(f"[`{r}`]({RULES_ANCHOR})" for r in check.rules) or "—"


def page(catalogue: Sequence[Check]) -> str:
    """The catalogue page: the summary table, then every check by category (ID, level, versions, title, the section
    of spec/PROTOCOL.md it enforces, for the newest version it applies to, and the rules of the table it enforces),
    as ``check --list`` prints it."""
    lines = ["# Check catalogue", "",
             "Generated from the catalogue (`ggml_rpc.conformance.checks.CATALOGUE`) when the site is built; "
             "`ggml-rpc check --list` prints the same list, `--checks` selects by ID or category "
             "(`'HELLO-*,cache-v7'`). The last column names the rules of the spec's "
             f"[rule table]({RULES_ANCHOR}) a check enforces: those its requests break for the server to refuse, "
             "and those the server's replies must keep.", "", table(catalogue), ""]
    by_category: dict[str, list[Check]] = {}
    for c in catalogue:
        by_category.setdefault(c.category.value, []).append(c)
    for name, checks in by_category.items():
        lines += [f"## {name}", "", "| ID | level | versions | title | spec | rules |", "|---|---|---|---|---|---|"]
        for c in checks:
            link = c.spec_link(None)
            lines.append(f"| {c.id} | {c.level.value} | {_cell(c.versions_label)} | {_cell(c.title)} | "
                         f"[{link.partition('#')[2]}]({link}) | {_rules(c)} |")
        lines.append("")
    return "\n".join(lines)


__all__ = ["ENFORCES", "RULES_ANCHOR", "CategoryRow", "page", "rows", "table"]
