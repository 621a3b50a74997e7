"""The compiled kernels made ready before a server answers anyone: compiled once per machine, loaded once per process.

numba compiles a kernel at its first call for the argument types of that call (a few seconds to half a minute per
kernel on a busy machine), holding the interpreter lock while it does.  A server that compiled on its first graph
would keep its first client waiting past any timeout, and a conformance verdict would then depend on whether this
machine had run the kit before.  :func:`compile_kernels` instead runs, before a server listens, small graphs that
take every compiled path of the executor with the argument types real graphs give them (contiguous and viewed
operands, every weight type with an exact product, one token and a batch, the plan's prepared steps and the
kernels' own), so that each kernel is compiled (first run on a machine, then written to numba's cache) or loaded
from the cache (every later process).  It runs once per process; a forked server process inherits its work.

A server started in a process of its own only needs the cache complete, not every kernel loaded (a kernel loads at
its first call in a fraction of a second): :func:`ensure_compiled` trusts a record the last complete warm-up left
beside numba's index (checked against the index itself), or the word of the process that started it (an environment
variable naming the sources' digest), and warms up only when neither holds.

What it may know: the executor's public entry points and its kernels' modules.  What it must not: anything of the
server, the protocol or the conformance checks; a graph a drill builds is refused or computed like any other.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.spec import GgmlOp, GgmlType, GluOp, TensorFlag, UnaryOp

from ..graph import ExecutorError, GraphTensor
from . import kernel_cache
from .arena import Arena, params
from .builds import BUILDS
from .grids import available
from .kdot import K_TYPES
from .lowbit_dot import LOWBIT_TYPES
from .memory import buffer_key
from .plan import prepare
from .q8dot import EXACT_TYPES

F32, F16, BF16, I32 = int(GgmlType.F32), int(GgmlType.F16), int(GgmlType.BF16), int(GgmlType.I32)
Q8_0 = int(GgmlType.Q8_0)

#: Row length of the drills' products: a whole number of blocks of every weight type (256: the K-quants' block).
_K = 256
#: Weight rows: a multiple of 4, so that a batch takes tinyBLAS's path for float weights.
_M = 8


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What :func:`compile_kernels` did: kernels ready, signatures new to this process (``compiled`` of them
    compiled here, the others loaded from numba's cache), drills refused, seconds."""

    kernels: int
    signatures: int
    compiled: int
    refused: tuple[str, ...]
    seconds: float

    def __str__(self) -> str:
        how = (f"{self.compiled} compiled on this machine, {self.signatures - self.compiled} loaded from the cache"
               if self.compiled else "loaded from the cache")
        return (f"{self.kernels} compiled kernels ready ({self.signatures} signatures new to this process: {how}) in "
                f"{self.seconds:.1f} s" + (f"; not exercised: {', '.join(self.refused)}" if self.refused else ""))


class _Graph:
    """The drills' two arenas: ``weights`` (never written by a graph, so its conversions are kept between runs as a
    server keeps them) and ``work`` (inputs, views and results)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.weights = Arena(1 << 20)
        self.work = Arena(4 << 20)

    def values(self, *shape: int) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(np.float32)

    def data(self, type_id: int, ne: tuple[int, ...], *, weight: bool = False) -> GraphTensor:
        """A tensor of ``type_id`` holding values (float types) or bytes of valid blocks (quantised types)."""
        arena = self.weights if weight else self.work
        t = arena.tensor(type_id, ne)
        raw = arena.raw(t)
        if type_id in (F32, F16, BF16):
            arena.set(t, self.values(*reversed((*ne, *[1] * (4 - len(ne))))))
        else:
            # Random bytes are blocks of every quantised type: a NaN or huge scale only makes NaN or infinite
            # results, and the kernels are compiled all the same.
            raw[...] = self.rng.integers(0, 256, raw.shape, dtype=np.uint8)
        return t

    def node(self, type_id: int, ne: tuple[int, ...], op: GgmlOp, *src: GraphTensor | None,
             p: np.ndarray | list[int] = ()) -> GraphTensor:
        return self.work.tensor(type_id, ne, op=int(op), src=src, params=p)

    def permuted(self, type_id: int, ne: tuple[int, int, int]) -> GraphTensor:
        """A [ne0, ne1, ne2] view with dims 1 and 2 swapped relative to its memory (a KV cache's layout)."""
        base = self.data(type_id, (ne[0], ne[2], ne[1]))
        nb = base.nb
        return self.work.view_of(base, ne, (nb[0], nb[2], nb[1], nb[3]), op=GgmlOp.PERMUTE)

    def run(self, *outputs: GraphTensor) -> None:
        """The graph of ``outputs`` (their sources first), run as the server runs it for every build: a plan run
        twice with the weights' conversions kept, then once more with nothing kept (the kernels' raw paths)."""
        nodes = list(_ordered(outputs))
        keep = {buffer_key(self.weights.view): 0}
        for build in BUILDS.values():
            plan = prepare(nodes, build)
            plan.run(keep)
            plan.run(keep)
            prepare(nodes, build).run()


def _ordered(outputs: tuple[GraphTensor, ...]) -> Iterator[GraphTensor]:
    seen: set[int] = set()

    def visit(t: GraphTensor) -> Iterator[GraphTensor]:
        if id(t) in seen:
            return
        seen.add(id(t))
        for s in t.src:
            if s is not None:
                yield from visit(s)
        if t.view_src is not None:
            yield from visit(t.view_src)
        yield t

    for t in outputs:
        yield from visit(t)


# ---- the drills: one per family of compiled paths ---------------------------------------------------------------


def _weight_types() -> list[int]:
    """Every weight type with a compiled product (the IQ types only with their codebooks loaded)."""
    types = [F32, F16, BF16, *EXACT_TYPES, *LOWBIT_TYPES, *K_TYPES]
    return [t for t in types if available(t)]


def _products(g: _Graph, type_id: int) -> None:
    w = g.data(type_id, (_K, _M), weight=True)
    one, batch = g.data(F32, (_K, 1)), g.data(F32, (_K, 5))
    # A batch whose rows are not contiguous (a transposed view): F32 weights then take the one-token loop.
    wide = g.data(F32, (5, _K))
    strided = g.work.view_of(wide, (_K, 5), (wide.nb[1], wide.nb[0], wide.nb[2], wide.nb[3]), op=GgmlOp.TRANSPOSE)
    outs = [g.node(F32, (_M, n), GgmlOp.MUL_MAT, w, x) for x, n in ((one, 1), (batch, 5), (strided, 5))]
    # Expert weights: MUL_MAT_ID dots each (expert, token) pair one token at a time.
    experts = g.data(type_id, (_K, _M, 2), weight=True)
    ids = g.data(I32, (2, 3))
    g.work.set_raw(ids, np.array([[0, 1], [1, 0], [1, 1]], dtype=np.int32))
    tokens = g.data(F32, (_K, 2, 3))
    outs.append(g.node(F32, (_M, 2, 3), GgmlOp.MUL_MAT_ID, experts, tokens, ids))
    g.run(*outs)


def _attention(g: _Graph, kv_type: int, n_q: int, *, viewed: bool, mask: int | None, sinks: bool,
               softcap: float) -> None:
    dk, n_kv, n_head, n_head_kv = 64, 70, 4, 2
    if viewed:
        # Q, K and V as llama.cpp passes them: Q permuted from the heads' product, K and V views of a cache whose
        # positions lie one row of all heads apart.
        q = g.permuted(F32, (dk, n_q, n_head))
        k, v = g.permuted(kv_type, (dk, n_kv, n_head_kv)), g.permuted(kv_type, (dk, n_kv, n_head_kv))
    else:
        q = g.data(F32, (dk, n_q, n_head))
        k, v = g.data(kv_type, (dk, n_kv, n_head_kv)), g.data(kv_type, (dk, n_kv, n_head_kv))
    m = g.data(mask, (n_kv, n_q + 3)) if mask is not None else None
    if m is not None:
        g.work.set(m, np.where(g.rng.random((1, 1, n_q + 3, n_kv)) < 0.2, -np.inf, 0).astype(np.float32))
    s = g.data(F32, (n_head,)) if sinks else None
    p = params(0.125 * (softcap or 1.0), 0.0, softcap)
    g.run(g.node(F32, (dk, n_head, n_q), GgmlOp.FLASH_ATTN_EXT, q, k, v, m, s, p=p))


def _rope(g: _Graph, src_type: int, mode: int, *, viewed: bool, factors: bool, in_place: bool) -> None:
    head, n_head, n_tok = 32, 2, 3
    if viewed:  # heads cut out of a wider row (a fused QKV product)
        wide = g.data(src_type, (3 * head * n_head, n_tok))
        row = wide.nb[1]
        x = g.work.view_of(wide, (head, n_head, n_tok), (wide.nb[0], head * wide.nb[0], row, row * n_tok))
    else:
        x = g.data(src_type, (head, n_head, n_tok))
    pos = g.data(I32, (n_tok,))
    g.work.set_raw(pos, np.arange(n_tok, dtype=np.int32))
    srcs: list[GraphTensor] = [x, pos]
    if factors:
        srcs.append(g.data(F32, (head // 2,)))
    p = params(0, head, mode, 0, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    if in_place:  # written over its source, as ggml_rope_inplace does
        out = g.work.view_of(x, x.ne, x.nb, op=GgmlOp.ROPE)
        out.src = [*srcs, *[None] * (len(out.src) - len(srcs))]
        out.op_params[: p.size] = p
        out.flags = x.flags | int(TensorFlag.COMPUTE)
    else:
        out = g.node(src_type, (head, n_head, n_tok), GgmlOp.ROPE, *srcs, p=p)
    g.run(out)


def _rows(g: _Graph, src_type: int) -> None:
    """The row kernels: RMS_NORM, SOFT_MAX (with masks and sinks), SILU and SWIGLU, TOP_K."""
    x = g.data(src_type, (64, 6))
    outs = [g.node(F32, (64, 6), GgmlOp.RMS_NORM, x, p=params(1e-6))]
    if src_type == F32:
        for mask in (None, F16, F32):
            m = g.data(mask, (64, 8)) if mask is not None else None
            sinks = g.data(F32, (1,))
            outs += [g.node(F32, (64, 6), GgmlOp.SOFT_MAX, x, m, p=params(0.5, 0.0)),
                     g.node(F32, (64, 6), GgmlOp.SOFT_MAX, x, m, sinks, p=params(1.0, 8.0))]
        outs += [g.node(I32, (5, 6), GgmlOp.TOP_K, x), g.node(I32, (64, 6), GgmlOp.ARGSORT, x, p=[1])]
    outs += [g.node(src_type, (64, 6), GgmlOp.UNARY, x, p=[int(UnaryOp.SILU)]),
             g.node(src_type, (32, 6), GgmlOp.GLU, x, p=[int(GluOp.SWIGLU), 0]),
             g.node(src_type, (64, 6), GgmlOp.GLU, x, g.data(src_type, (64, 6)), p=[int(GluOp.SWIGLU), 0])]
    g.run(*outs)


def _fused(g: _Graph) -> None:
    """A run of float32 ADD/SUB/MUL/DIV nodes long enough to be fused into one compiled call."""
    a, row = g.data(F32, (16, 4)), g.data(F32, (16,))
    x = a
    ops = (GgmlOp.ADD, GgmlOp.MUL, GgmlOp.SUB, GgmlOp.DIV)
    for i in range(12):
        x = g.node(F32, (16, 4), ops[i % 4], x, row if i % 3 else a)
    g.run(x)


def _drills() -> list[tuple[str, Callable[[_Graph], None]]]:
    drills: list[tuple[str, Callable[[_Graph], None]]] = [
        (f"MUL_MAT {GgmlType(t).name}", lambda g, t=t: _products(g, t)) for t in _weight_types()]
    for kv in (F16, F32, BF16, Q8_0):
        for n_q in (1, 7, 64):
            if n_q == 64 and kv in (BF16, Q8_0):
                continue  # the tiled path takes F16/F32 K and V only
            drills += [(f"FLASH_ATTN_EXT {GgmlType(kv).name} x {n_q}",
                        lambda g, kv=kv, n_q=n_q, viewed=viewed, mask=mask, sinks=sinks, cap=cap:
                        _attention(g, kv, n_q, viewed=viewed, mask=mask, sinks=sinks, softcap=cap))
                       for viewed in (True, False)
                       for mask, sinks, cap in ((F16, False, 0.0), (F32, True, 30.0), (None, False, 0.0))]
    for src_type in (F32, F16):
        for mode in (0, 2):
            drills += [(f"ROPE {GgmlType(src_type).name} mode {mode}",
                        lambda g, s=src_type, m=mode, v=viewed, f=factors, i=in_place:
                        _rope(g, s, m, viewed=v, factors=f, in_place=i))
                       for viewed, factors, in_place in ((False, False, False), (True, True, False),
                                                         (False, False, True))]
        drills.append((f"rows {GgmlType(src_type).name}", lambda g, s=src_type: _rows(g, s)))
    drills.append(("fused binary run", _fused))
    return drills


# ---- running them -----------------------------------------------------------------------------------------------


_lock = threading.Lock()
#: Drills this process has run (or seen refused): each runs once per process.
_drilled: set[str] = set()


def compile_kernels(on_compile: Callable[[], None] | None = None) -> WarmUp:
    """Compile (or load from numba's cache) every kernel the executor's paths call.  Each drill runs once per
    process (one refused for want of a codebook runs again once the codebook is loaded); a call with nothing left
    to do returns at once.  ``on_compile`` is called once, when numba starts compiling a kernel rather than loading
    it (a first run on this machine: tens of seconds), so that whoever waits can be told why."""
    with _lock:
        todo = [(name, drill) for name, drill in _drills() if name not in _drilled]
        if not todo:
            return WarmUp(0, 0, 0, (), 0.0)
        started = time.monotonic()
        before = sum(len(k.signatures) for k in kernels().values())
        if not _drilled:
            kernel_cache.preload()  # every signature a former run compiled (graphs of other layouts included)
        refused = []
        compiles = _Compiles(on_compile)
        with _listening(compiles), np.errstate(all="ignore"):
            for name, drill in todo:
                try:
                    drill(_Graph(np.random.default_rng(0)))
                except ExecutorError:
                    refused.append(name)
                    continue
                _drilled.add(name)
        ready = kernels()
        _record(ready)
        if not refused:
            os.environ[READY] = _ready_token()  # for the servers this process starts (see ensure_compiled)
        return WarmUp(len([k for k in ready.values() if k.signatures]),
                      sum(len(k.signatures) for k in ready.values()) - before, compiles.top_level, tuple(refused),
                      time.monotonic() - started)


def ensure_compiled(on_compile: Callable[[], None] | None = None) -> WarmUp | None:
    """What a server starting in a process of its own needs: every kernel in numba's cache, not necessarily loaded
    (a kernel loads at its first call in a fraction of a second; it is a compile that takes seconds).  When a
    complete warm-up recorded what it left in the cache and the cache still holds it, nothing is done (a few index
    files read: the fuzzer restarts its target after every crash); otherwise :func:`compile_kernels` runs."""
    if os.environ.get(READY) == _ready_token():
        return None  # a parent (the command that started this server) has just made the cache complete
    with _lock:
        if not _drilled and cached():
            return None
    return compile_kernels(on_compile)


#: Set by a process whose warm-up completed (to :func:`_ready_token`): the servers it starts, which inherit its
#: environment, find the cache complete without reading it, nor loading numba.
READY = "GGML_RPC_KIT_KERNELS_READY"


def _ready_token() -> str:
    """The executor sources' digest and numba's cache folder as the environment names it: a child that points numba
    elsewhere (NUMBA_CACHE_DIR) is not told its cache is complete."""
    return f"{_sources()}:{os.environ.get('NUMBA_CACHE_DIR', '')}"


#: Beside numba's cached kernels: what the last complete warm-up left there (sources, drills, entries per kernel).
_RECORD = "ggml-rpc-warmup.json"


def cached() -> bool:
    """Whether numba's cache holds what a complete warm-up of these sources left there, usable by this process (the
    same processor and numba): the record beside it names the drills and the entries per kernel, and each kernel's
    index still has that many entries this process can load."""
    ready = kernels()
    path = _record_path(ready)
    try:
        record = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("sources") != _sources():
        return False
    if not {name for name, _ in _drills()} <= set(record.get("drills", ())):
        return False
    for name, count in dict(record.get("kernels", {})).items():
        kernel = ready.get(name)
        if kernel is None or _usable(kernel) < count:
            return False
    return True


def _record(ready: dict[str, Any]) -> None:
    """After a warm-up: the record :func:`cached` reads (nothing when numba caches nowhere)."""
    path = _record_path(ready)
    if path is None:
        return
    record = {"sources": _sources(), "drills": sorted(_drilled),
              "kernels": {name: _usable(k) for name, k in ready.items()}}
    try:
        path.write_text(json.dumps(record, indent=1))
    except OSError:
        pass  # a read-only cache: every process warms up, as without a record


def _record_path(ready: dict[str, Any]) -> Path | None:
    for kernel in ready.values():
        folder = getattr(getattr(kernel, "_cache", None), "_cache_path", None)  # numba's FunctionCache
        if folder:
            return Path(folder) / _RECORD
    return None


def _usable(kernel: Any) -> int:
    """Entries of ``kernel``'s cache index this process can load (compiled for this processor, from these sources);
    0 when numba's cache is laid out otherwise."""
    try:
        cache = kernel._cache
        codegen = kernel.targetctx.codegen()
        return sum(1 for key in cache._cache_file._load_index() if key == cache._index_key(key[0], codegen))
    except (AttributeError, OSError, TypeError, ValueError):
        return 0


def _sources() -> str:
    return kernel_cache.sources_digest(Path(__file__).parent)


class _Compiles:
    """Counts numba's compiles (a load from its cache is none) of kernels called from Python, and says when the
    first one starts (numba's event listener interface: ``on_start``/``on_end``, see :func:`_listening`)."""

    def __init__(self, first: Callable[[], None] | None) -> None:
        self.first = first
        self.depth = 0
        self.top_level = 0

    def on_start(self, ev: object) -> None:
        if self.depth == 0:
            if self.top_level == 0 and self.first is not None:
                self.first()
            self.top_level += 1
        self.depth += 1

    def on_end(self, ev: object) -> None:
        self.depth -= 1


def _listening(counter: _Compiles) -> Any:
    """``counter`` installed as numba's listener of its "numba:compile" events (a context manager); numba is
    imported here, not with this module, so that a server that finds its kernels ready never loads it."""
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            counter.on_start(ev)

        def on_end(self, ev: event.Event) -> None:
            counter.on_end(ev)

    return event.install_listener("numba:compile", Listener())


def kernels() -> dict[str, Any]:
    """Every kernel of the executor compiled on its own (``module.name`` -> dispatcher); the helpers they inline
    are compiled into them, not on their own."""
    from numba.core.registry import CPUDispatcher

    package = __name__.rpartition(".")[0]
    found: dict[str, Any] = {}
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.name == "compiled" or _numba_module(info.name):
            module = importlib.import_module(f"{package}.{info.name}")
            for name, k in vars(module).items():
                if (isinstance(k, CPUDispatcher) and k.__module__ == module.__name__
                        and k.targetoptions.get("inline", "never") == "never"):
                    found[f"{info.name}.{name}"] = k
    return found


def signatures() -> dict[str, int]:
    """How many signatures each kernel has compiled or loaded in this process (a change after :func:`compile_kernels`
    is a compile a client waited for)."""
    return {name: len(k.signatures) for name, k in kernels().items()}


def _numba_module(name: str) -> bool:
    # The executor's modules that compile kernels (read from their sources, so a new one is found without a list).
    spec = importlib.util.find_spec(f"{__name__.rpartition('.')[0]}.{name}")
    origin = getattr(spec, "origin", None)
    if not origin:
        return False
    with open(origin, encoding="utf-8") as f:
        return "@njit" in f.read()
