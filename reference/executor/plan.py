"""Prepared graph runs: what a graph needs that does not depend on buffer contents, worked out once.

:func:`prepare` walks the nodes once and decides, per node, whether it runs at all (FREE ops, nodes without the
COMPUTE flag and empty nodes do not), which kernel runs it, and the numpy views of its tensors (bounds-checked as
they are built).  An op with a prepared form (see :data:`~.core.PREPARED`), such as a same-shape F32 ADD, becomes
one numpy call on views made in advance; every other op calls its kernel with a :class:`~.memory.Memory` that
already holds the views.  :meth:`Plan.run` then only runs kernels: everything that depends on data (index ranges,
expert ids...) is still checked by the kernels on every run.

Nothing is refused while preparing: a node that cannot be prepared (unsupported op, a view outside its buffer)
keeps a step that refuses it when the run reaches it, so a plan fails at the same node, with the same message,
after the same earlier writes, as running the nodes one by one.  A plan is valid as long as the buffers its
tensors live in; whoever keeps one must drop it when one of those buffers is freed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp, TensorFlag, op_name

from ..graph import ExecutorError, GraphTensor, paused_collections
from .builds import DEFAULT_BUILD, Build
from .core import KERNELS, PREPARED
from .fused import fuse
from .memory import Memory, buffer_key, node_error

#: Ops that only describe memory (their data is already where the view points): nothing to compute.
FREE_OPS = frozenset(int(op) for op in (GgmlOp.NONE, GgmlOp.VIEW, GgmlOp.RESHAPE, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE))
_COMPUTE = int(TensorFlag.COMPUTE)
_CAUGHT = (ValueError, TypeError, IndexError, MemoryError, FloatingPointError)

# One step: (function, arguments); a kernel's arguments are (node, memory).  Every step is called alike, fn(*args):
# one call per node and no test in the loop, which for a graph of thousands of tiny ops is most of its time.
Step = tuple[Callable[..., Any], tuple[Any, ...]]


def _refuse(message: str) -> None:
    raise ExecutorError(message)  # a new exception per run: a kept one would carry every earlier traceback


class Plan:
    """The steps of one graph, ready to run any number of times (by one thread at a time)."""

    __slots__ = ("_memory", "_node_of", "kinds", "nodes", "steps", "written")

    def __init__(self, steps: list[Step], nodes: list[GraphTensor], kinds: list[str], memory: Memory,
                 written: frozenset[int]) -> None:
        self.steps = steps
        #: The node of each step, and how it runs: "prepared" (one numpy call made in advance), "fused" (a run
        #: of float32 binary nodes in one compiled call, :mod:`.fused`; its node is the run's first), "kernel" or
        #: "refused" (the refusal the run raises when it reaches the node).
        self.nodes = nodes
        self.kinds = kinds
        self._node_of = {id(args): node for (_fn, args), node in zip(steps, nodes, strict=True)}
        self._memory = memory
        #: :func:`~.memory.buffer_key` of the buffers any node writes into.
        self.written = written
        memory.written = written
        memory.seal()

    def run(self, epochs: Mapping[int, int] | None = None) -> None:
        """Run every step in order, writing each result into its node's memory.

        ``epochs`` (:func:`~.memory.buffer_key` -> write epoch, see :class:`~.memory.Memory`) lets kernels reuse
        the float32 conversions of weights made by earlier runs; without it every run converts afresh.
        """
        mem = self._memory
        mem.epochs = epochs
        args: tuple[Any, ...] | None = None
        try:
            for fn, args in self.steps:
                fn(*args)
        except ExecutorError as exc:
            node = self._node_of[id(args)]
            if str(exc).startswith(op_name(node.op) + ":"):
                raise
            raise node_error(node, str(exc)) from None  # name the op, its types and shapes in every refusal
        except _CAUGHT as exc:
            raise node_error(self._node_of[id(args)], f"cannot compute: {exc}") from exc
        finally:
            # Kernels may make views of tensors of their own (an expert's slice): those live for one run only.
            mem.unseal_run()


def prepare(nodes: Sequence[GraphTensor], build: Build = DEFAULT_BUILD) -> Plan:
    """The plan of ``nodes``: one step per node that computes, in order (never raises for a bad node), computing as
    upstream's ``build`` does where builds differ."""
    with paused_collections():
        return _prepare(nodes, build)


def _prepare(nodes: Sequence[GraphTensor], build: Build) -> Plan:
    mem = Memory(build)
    steps: list[Step] = []
    stepped: list[GraphTensor] = []
    kinds: list[str] = []

    def add(step: Step, node: GraphTensor, kind: str) -> None:
        steps.append(step)
        stepped.append(node)
        kinds.append(kind)

    kernels, ready = KERNELS, PREPARED
    for node in nodes:
        op = node.op
        if op in FREE_OPS:
            continue
        if op in NATIVE_CALLBACK_OPS:
            why = "ops carrying native function pointers are never executed"
            add((_refuse, (str(node_error(node, why)),)), node, "refused")
            continue
        if not node.flags & _COMPUTE:
            continue
        ne = node.ne
        if ne[0] == 0 or ne[1] == 0 or ne[2] == 0 or ne[3] == 0:
            continue
        fn = kernels.get(op)
        if fn is None:
            why = f"op {op_name(op)} is not supported by the reference executor"
            add((_refuse, (str(node_error(node, why)),)), node, "refused")
            continue
        prep = ready.get(op)
        if prep is not None:
            try:
                call = prep(node, mem)
            except (ExecutorError, *_CAUGHT):
                call = None
            if call is not None:
                add((call[0], call[1]), node, "prepared")
                continue
        # The kernel's views are made now, once; one that cannot be made is left for the kernel, which refuses it
        # in its turn.
        for t in (node, *node.src):
            if t is not None and t.buffer is not None:
                try:
                    mem.raw(t)
                except ExecutorError:
                    pass
        add((fn, (node, mem)), node, "kernel")
    # Only nodes that run write: a VIEW or RESHAPE of a weight (a node too) leaves the weight's buffer alone.
    written = frozenset(buffer_key(node.buffer) for node in stepped if node.buffer is not None)
    steps, stepped, kinds = fuse(steps, stepped, kinds)  # runs of small float32 binary nodes: one compiled call
    return Plan(steps, stepped, kinds, mem, written)


def execute(nodes: Sequence[GraphTensor]) -> None:
    """Run ``nodes`` in order, writing each result into the node's own memory."""
    prepare(nodes).run()
