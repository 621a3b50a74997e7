"""Upstream's known RPC memory-safety reports, by class (A–G), and what in the kit covers each.

This is data: each report names the checks whose outcome against a server says whether that server has the bug
(a death, a sanitizer report, leaked or corrupted bytes: rediscovered; a pass: shown fixed) and the hunt
strategies aimed at it. :mod:`.security_table` runs those checks against every installed peer, plain and
instrumented, and renders the table (``SECURITY.md``). A report whose checks do not apply to a version (the op or
command does not exist there) is "not applicable" for it, never "fixed".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..checks.shadow import SHADOW_CHECKS
from ..harness import Check

#: The classes, as issue reports and advisories group them.
CLASSES: dict[str, str] = {
    "A": "deserialize_tensor bounds bypass",
    "B": "size arithmetic",
    "C": "unvalidated type or shape",
    "D": "graph structure",
    "E": "kernel bounds through GRAPH_COMPUTE",
    "F": "control-flow hijack",
    "G": "resource exhaustion and cache integrity",
}


@dataclass(frozen=True, slots=True)
class KnownBug:
    """One upstream report (or a group of reports of one bug) and the kit's coverage of it."""

    key: str
    reports: str
    what: str
    #: Check ids whose failure against a server is this bug (any of them).
    checks: tuple[str, ...]
    #: ``ggml-rpc fuzz --hunt`` strategies aimed at it (names in :mod:`ggml_rpc.conformance.fuzz.hunt_strategies`).
    strategies: tuple[str, ...] = ()
    #: Coverage outside the check catalogue (tests of the reference), said in words.
    also: str = ""
    #: Majors whose protocol *is* the bug (no check can call it fixed there), each with the check that shows the
    #: behaviour (it passes on such a server): the cell says "present by design" only when it did.
    by_design: tuple[tuple[int, str], ...] = ()
    #: The hunt's flaw classes it explains (a findings.json class's ``rule`` starting with one of them, see
    #: :func:`explained_by`).
    flaws: tuple[str, ...] = ()
    #: A write out of bounds: it also explains what the shadow-memory oracle sees (a ``corruption``) of its flaws.
    writes: bool = False
    #: Reproducers in ``fixtures/repro/`` (the bugs the kit found: each replays clean against the reference).
    reproducers: tuple[str, ...] = ()
    #: Commands it is about (empty: any), and a phrase the flawed request's description must carry (``zero
    #: elements``): a class that carries a phrase some bug names is explained by such a bug only.
    commands: tuple[str, ...] = ()
    detail: str = ""
    #: A death at an assertion of this source file is the build refusing the input (upstream's own check), not the
    #: bug: such a failure says the bug is absent there.
    refused_at: str = ""

    @property
    def cls(self) -> str:
        return self.key[0]


KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug("A1", "GHSA-wcr5-566p-9cwj, GHSA-5vm9-p64x-gqw9, GHSA-mqp6-7pv6-fqjf",
             "SET/GET/COPY_TENSOR: a tensor's data (or data + nbytes, or the region) outside its buffer",
             ("FRAME-010", "FRAME-011", "FRAME-014", "FRAME-015", "FRAME-017", "FRAME-018", "FRAME-020"),
             ("region_edge",), flaws=("bound:",)),
    KnownBug("A2", "CVE-2026-34159 / GHSA-j8rj-fmpv-wcxw (PR #20908)",
             "GRAPH_COMPUTE: a tensor with buffer 0 skipped every check in graph node creation",
             ("FRAME-029", "FRAME-052", "FRAME-053"), ("foreign_buffer",), flaws=("buffer:",)),
    KnownBug("B1", "#9799", "ne[i] = 0: size arithmetic underflows", ("FRAME-049",), ("size_arithmetic",),
             flaws=("arith:",)),
    KnownBug("B4", "size arithmetic past 2^64, views", "ne x nb wrapping 64 bits; a view whose view_offs lies past "
             "its source", ("FRAME-050", "FRAME-051"), ("size_arithmetic",), flaws=("arith:",)),
    KnownBug("B2", "ggml PR #1103", "COPY_TENSOR copied ggml_nbytes(src) into a smaller dst", ("FRAME-022",)),
    KnownBug("B3", "PR #16421", "COPY_TENSOR with a source of no known buffer", ("FRAME-021",)),
    KnownBug("C1", "#13067", "a tensor type >= GGML_TYPE_COUNT in SET_TENSOR", ("FRAME-008", "FRAME-024"),
             flaws=("type: tensor.type", "type: tensors.*.type", "type: src.type", "type: dst.type")),
    KnownBug("C2", "PR #20712", "a removed type (block size 0): SIGFPE", ("FRAME-009",)),
    KnownBug("C3", "#25288", "ne[0] not a multiple of the type's block size (SET/GET/SET_TENSOR_HASH/INIT/COPY/"
             "GRAPH_COMPUTE)", ("FRAME-048",), ("block_misaligned",), flaws=("block:",)),
    KnownBug("D1", "#25299 (PR #25670 and its regression test)", "GRAPH_COMPUTE naming node id 0: a null node",
             ("FRAME-031",), ("null_node",), flaws=("id: nodes",)),
    KnownBug("D2", "graph ids out of range, deep src chains", "a node or src id that resolves to no tensor; a "
             "src chain 300,000 deep", ("FRAME-028", "FRAME-030", "FRAME-038"), ("deep_chain",),
             flaws=("id: tensors", "deep")),
    KnownBug("D3", "graph cycles", "a node its own source, a -> b -> a, a view of itself, a node listed twice",
             ("FRAME-054",), ("graph_structure",), flaws=("graph:",)),
    KnownBug("E1", "#25704", "GATED_DELTA_NET op_params out of range (write)", ("FRAME-059",), ("kernel_bounds",),
             flaws=("kernel: GATED_DELTA_NET",), writes=True),
    KnownBug("E2", "#25764", "ACC / SET with negative strides (write)", ("FRAME-057",), ("kernel_bounds",),
             flaws=("kernel: ACC", "kernel: SET."), writes=True),
    KnownBug("E3", "#25765", "SSM_SCAN ids out of range (read/write)", ("FRAME-058",), ("kernel_bounds",),
             flaws=("kernel: SSM_SCAN",), writes=True),
    KnownBug("E4", "#26825", "GET_ROWS row indices out of range, read back by GET_TENSOR", ("FRAME-055",),
             ("get_rows_index", "kernel_bounds"), flaws=("kernel: GET_ROWS", "index: GET_ROWS")),
    KnownBug("E5", "#26912", "SET_ROWS row indices out of range (write)", ("FRAME-056",), ("kernel_bounds",),
             flaws=("kernel: SET_ROWS", "index: SET_ROWS"), writes=True),
    KnownBug("F1", "#25289", "CUSTOM / MAP_CUSTOM* op_params carry a function pointer: a client-chosen call",
             ("FRAME-060",), ("custom_op",), flaws=("custom:",)),
    KnownBug("G1", "the 1.4 TB cache behind protocol 7.0.0", "v6 `-c` cached every transfer above 10 MiB, "
             "activations included", ("CACHE-V7-002",),
             by_design=((6, "CACHE-V6-001"),)),
    KnownBug("G2", "truncated cache entries served as valid", "a hash hit whose file is not the bytes hashed",
             ("CACHE-V7-004", "CACHE-V7-006", "CACHE-V6-004"),
             also="the reference's own cache: tests/reference/test_ref_cache_trust.py (mapping writes, coarse "
                  "clocks, truncation, ctime)"),
    KnownBug("G3", "size headers a server trusts (no upstream report)",
             "a server that allocates what a peer merely claims (size headers of 2^32 and 2^63 bytes)",
             ("FRAME-033", "FRAME-036", "FRAME-037"), ("huge_claim",), flaws=("size: claim",)),
)

#: Bugs the kit found that no upstream report names yet (``N``): each with its statement in protocol terms, the
#: checks that show it, and reproducers that replay clean against the reference.  The security run measures them
#: on every build as it measures the reports.
NEW_BUGS: tuple[KnownBug, ...] = (
    KnownBug("N1", "no report; found by SHADOW-011 and the hunt's empty_outside",
             "COPY_TENSOR whose destination has zero elements is accepted wherever its data address lies below its "
             "buffer's end (deserialize_tensor does not check a tensor of zero elements; the copy checks only the "
             "end), and ggml_nbytes(src) bytes are written there: into another buffer of the connection, over the "
             "heap header of the buffer's allocation (SIGABRT when it is freed), or far below it (SIGSEGV)",
             ("SHADOW-011",), ("empty_outside",), flaws=("bound: dst.data",), writes=True,
             reproducers=("fixtures/repro/v8-copy-tensor-zero-elements-below.pcap",
                          "fixtures/repro/v8-copy-tensor-zero-elements-wild.pcap"),
             commands=("COPY_TENSOR",), detail="zero elements", refused_at="ggml-rpc.cpp"),
)
#: Phrases of a flawed request's description that only a bug naming them explains.
_DETAILS = frozenset(b.detail for b in (*KNOWN_BUGS, *NEW_BUGS) if b.detail)


def explained_by(found: dict[str, Any]) -> KnownBug | None:
    """The report (or kit-found bug) that explains a hunt's class (an entry of findings.json's ``classes``), or
    None: what no report names.  By the flaw of the request that failed (``rule``), its command, and the kind of
    failure: a crash, a hang or a leak of a report's flaw is that report's; a ``corruption`` (bytes written where
    the request did not name) only a write's; a request the spec allows (``valid``), a client that leaves early,
    and flaws no report is about are nobody's.  Attribution by flaw errs toward "explained": a new bug whose flaw
    an old report shares is not shown as new."""
    rule, kind = found.get("rule") or "", found.get("kind") or ""
    text = found.get("broken") or ""
    details = {d for d in _DETAILS if d in text}
    for bug in (*NEW_BUGS, *KNOWN_BUGS):
        if not any(rule.startswith(f) for f in bug.flaws):
            continue
        if bug.commands and found.get("command") not in bug.commands:
            continue
        if details and bug.detail not in details:
            continue
        if kind == "corruption" and not bug.writes:
            continue
        return bug
    return None


#: The classes whose inputs kill or corrupt some build (the rest, G, is about what a server keeps or caches).
MEMORY_SAFETY_CLASSES = frozenset("ABCDEF")


def harmful_checks() -> frozenset[str]:
    """The checks of the known memory-safety bugs: each sends an input that kills or corrupts some build."""
    return frozenset(c for bug in KNOWN_BUGS if bug.cls in MEMORY_SAFETY_CLASSES for c in bug.checks)


def safe_profile(checks: Iterable[Check]) -> list[Check]:
    """``ggml-rpc check --profile safe``: the checks that send only requests valid per the spec
    (:attr:`~ggml_rpc.conformance.harness.Check.bad_input` False) and that no known memory-safety bug names
    (:func:`harmful_checks`), for a server someone depends on.  A partial profile: the verdict says so."""
    harmful = harmful_checks()
    return [c for c in checks if not c.bad_input and c.id not in harmful]


def explained_checks() -> list[str]:
    """The checks whose failure against an upstream build a report or a kit-found bug explains, in table order."""
    seen: dict[str, None] = {}
    for bug in (*KNOWN_BUGS, *NEW_BUGS):
        seen.update(dict.fromkeys(bug.checks))
        seen.update(dict.fromkeys(check for _, check in bug.by_design))
    return list(seen)


def all_checks() -> list[str]:
    """Every check id the security run measures, once each: :func:`explained_checks` and every shadow-memory check
    (where the kit finds what no report names)."""
    return list(dict.fromkeys([*explained_checks(), *(c.id for c in SHADOW_CHECKS)]))


__all__ = ["CLASSES", "KNOWN_BUGS", "MEMORY_SAFETY_CLASSES", "NEW_BUGS", "KnownBug", "all_checks", "explained_by",
           "explained_checks", "harmful_checks", "safe_profile"]
