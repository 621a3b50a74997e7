"""Interop rows of upstream ``test-backend-ops``: per op, through the reference server v7 and upstream's own.

One process per op and server: the upstream client aborts the whole process when a server closes a connection, so
one refused case must not hide the rest. A row passes when the reference server passes every case that upstream's
own server passes, compared case by case by name (``ADD(type=f32,ne=[16,10,1,1],...)`` as test-backend-ops prints
it), and the run finished: equal pass counts could hide one case lost and another gained.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ggml_rpc.spec.enums import GgmlOp, GluOp, UnaryOp

from .cells import FAIL, PASS, UNSUPPORTED, Cell, Row
from .interpose import BackendOpsResult, run_backend_ops
from .peers import PEERS
from .runs import UpstreamServer, reference_server
from .workspace import Workspace

#: The fixed subset CI runs (`--ops` default): element-wise, normalisation, softmax, copies and small reductions
#: whose whole upstream case lists run in seconds, plus the ops that read every quantised type (MUL_MAT, GET_ROWS,
#: CPY, OUT_PROD: about 4.5 minutes together on 2 cores). `--ops all` runs every op upstream tests (~50 min).
#: Each was measured to pass every upstream case through the reference server (conformance/upstream/op_counts.json).
CI_OPS = ("ADD", "SUB", "MUL", "DIV", "SCALE", "SQR", "SQRT", "RMS_NORM", "NORM", "SOFT_MAX", "SILU", "GELU",
          "CONT", "SET_ROWS", "ROPE", "SWIGLU", "CONCAT", "GET_ROWS", "CPY", "OUT_PROD", "MUL_MAT")


def ops_from_option(option: str | None) -> list[str]:
    if option in (None, ""):
        return list(CI_OPS)
    if option == "none":
        return []
    if option == "all":
        # test-backend-ops names a UNARY or GLU case by its sub-op (`-o SILU`, `-o SWIGLU`), never by UNARY/GLU.
        return ([o.name for o in GgmlOp if o.name not in ("NONE", "UNARY", "GLU")] + [o.name for o in UnaryOp]
                + [o.name for o in GluOp])
    return [o.strip().upper() for o in option.split(",") if o.strip()]


def _describe(r: BackendOpsResult, op: str) -> str:
    text = f"{r.passed.get(op, 0)}/{r.total(op)}"
    if r.aborted:
        text += f" (aborted: exit {r.exit_code}{'; ' + r.stderr_tail if r.stderr_tail else ''})"
    return text


#: The reference side may take this many times as long as upstream's side may: a numpy executor is slower than
#: ggml's C, and a cut run would report cases as missing that merely had not run yet.
REFERENCE_TIME_FACTOR = 6.0


#: Case names listed per difference in a row's figures (a whole op can have thousands of cases).
LISTED = 20


@dataclass(frozen=True)
class CaseDiff:
    """Cases that pass through one server and not the other (by name; a name printed twice counts twice)."""

    #: Upstream's server passes them, the reference does not (failed, declined, or never ran): the row fails.
    lost: list[str]
    #: The reference passes them, upstream's server does not: reported, not a failure.
    gained: list[str]


def compare_cases(reference: BackendOpsResult, upstream: BackendOpsResult, op: str) -> CaseDiff:
    """The cases of ``op`` whose outcome differs between the two runs."""
    def mine(r: BackendOpsResult) -> Counter[str]:
        return Counter({name: n for name, n in r.ok_cases.items() if name.startswith(f"{op}(")})

    ref, up = mine(reference), mine(upstream)
    return CaseDiff(sorted((up - ref).elements()), sorted((ref - up).elements()))


def op_row(op: str, timeout: float = 900.0) -> Cell:
    """Both runs at once: one after the other, the upstream run alone was nearly half of the row's time (MUL_MAT: 96
    of 232 s on 2 cores); at once, the CI subset's rows took 602 s instead of 661 (MUL_MAT 196 s; the one-case ops
    about 3 s longer each, two servers starting together)."""
    peer = PEERS["7.0.0"]
    with UpstreamServer(peer, cache=False) as server, reference_server(7, None) as address, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="backend-ops-reference") as pool:
        # The reference may take up to REFERENCE_TIME_FACTOR times upstream's time; upstream's is not known yet
        # when both start, so its bound is the factor times upstream's own bound (never shorter than before).
        reference_run = pool.submit(run_backend_ops, peer, address, op, timeout=REFERENCE_TIME_FACTOR * timeout)
        upstream = run_backend_ops(peer, server.address, op, timeout=timeout)
        reference = reference_run.result()
    return judge(op, reference, upstream)


def judge(op: str, reference: BackendOpsResult, upstream: BackendOpsResult) -> Cell:
    """The row's cell: PASS when the reference passes every case upstream's server passes (by name) and finished."""
    diff = compare_cases(reference, upstream, op)
    figures = {"reference": [reference.passed.get(op, 0), reference.total(op)],
               "upstream": [upstream.passed.get(op, 0), upstream.total(op)],
               "seconds": [round(reference.seconds, 1), round(upstream.seconds, 1)],
               "reference_failures": reference.failures[:5],
               "only_upstream_passes": diff.lost[:LISTED], "only_reference_passes": diff.gained[:LISTED]}
    detail = f"reference {_describe(reference, op)}, upstream {_describe(upstream, op)}"
    if upstream.total(op) == 0 and not upstream.aborted:
        return Cell(UNSUPPORTED, f"upstream tests no case of {op} on RPC0", figures)
    ok = not reference.aborted and not diff.lost
    if diff.lost:
        detail += f"; {len(diff.lost)} case(s) pass only upstream, first: {diff.lost[0]}"
    if diff.gained:
        detail += f"; {len(diff.gained)} case(s) pass only through the reference, first: {diff.gained[0]}"
    if not ok and reference.failures:
        detail += f"; first failure: {reference.failures[0]}"
    return Cell(PASS if ok else FAIL, detail, figures)


def backend_ops_rows(versions: list[str], ws: Workspace, option: str | None) -> Iterator[Row]:
    if "7.0.0" not in versions:
        return
    for op in ops_from_option(option):
        yield Row(f"OPS-{op}", f"test-backend-ops -o {op}: reference v7 vs upstream v7", "7.0.0",
                  lambda o=op: op_row(o))
