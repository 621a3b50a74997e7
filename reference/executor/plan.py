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
from .core import KERNELS, PREPARED
from .memory import Memory, buffer_key, node_error

#: Ops that only describe memory (their data is already where the view points): nothing to compute.
FREE_OPS = frozenset(int(op) for op in (GgmlOp.NONE, GgmlOp.VIEW, GgmlOp.RESHAPE, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE))
_COMPUTE = int(TensorFlag.COMPUTE)
_CAUGHT = (ValueError, TypeError, IndexError, MemoryError, FloatingPointError)

# One step: (function, arguments, node).  Arguments None: a kernel, called as fn(node, mem).
Step = tuple[Callable[..., Any], tuple[Any, ...] | None, GraphTensor]


def _refuse(message: str) -> None:
    raise ExecutorError(message)  # a new exception per run: a kept one would carry every earlier traceback


class Plan:
    """The steps of one graph, ready to run any number of times."""

    __slots__ = ("_generic", "_memory", "steps", "written")

    def __init__(self, steps: list[Step], memory: Memory, generic: bool, written: frozenset[int]) -> None:
        self.steps = steps
        self._memory = memory
        self._generic = generic
        #: :func:`~.memory.buffer_key` of the buffers any node writes into.
        self.written = written
        memory.written = written

    def run(self, epochs: Mapping[int, int] | None = None) -> None:
        """Run every step in order, writing each result into its node's memory.

        ``epochs`` (:func:`~.memory.buffer_key` -> write epoch, see :class:`~.memory.Memory`) lets kernels reuse
        the float32 conversions of weights made by earlier runs; without it every run converts afresh.
        """
        self._memory.epochs = epochs
        # Kernels may make views of tensors of their own (an expert's slice): those live for one run only.
        mem = self._memory.fork() if self._generic else self._memory
        node: GraphTensor | None = None
        try:
            for fn, args, node in self.steps:
                if args is None:
                    fn(node, mem)
                else:
                    fn(*args)
        except ExecutorError as exc:
            assert node is not None
            if str(exc).startswith(op_name(node.op) + ":"):
                raise
            raise node_error(node, str(exc)) from None  # name the op, its types and shapes in every refusal
        except _CAUGHT as exc:
            assert node is not None
            raise node_error(node, f"cannot compute: {exc}") from exc


def prepare(nodes: Sequence[GraphTensor]) -> Plan:
    """The plan of ``nodes``: one step per node that computes, in order (never raises for a bad node)."""
    with paused_collections():
        return _prepare(nodes)


def _prepare(nodes: Sequence[GraphTensor]) -> Plan:
    mem = Memory()
    steps: list[Step] = []
    generic = False
    kernels, ready = KERNELS, PREPARED
    for node in nodes:
        op = node.op
        if op in FREE_OPS:
            continue
        if op in NATIVE_CALLBACK_OPS:
            why = "ops carrying native function pointers are never executed"
            steps.append((_refuse, (str(node_error(node, why)),), node))
            continue
        if not node.flags & _COMPUTE:
            continue
        ne = node.ne
        if ne[0] == 0 or ne[1] == 0 or ne[2] == 0 or ne[3] == 0:
            continue
        fn = kernels.get(op)
        if fn is None:
            why = f"op {op_name(op)} is not supported by the reference executor"
            steps.append((_refuse, (str(node_error(node, why)),), node))
            continue
        prep = ready.get(op)
        if prep is not None:
            try:
                call = prep(node, mem)
            except (ExecutorError, *_CAUGHT):
                call = None
            if call is not None:
                steps.append((call[0], call[1], node))
                continue
        # The kernel's views are made now, once; one that cannot be made is left for the kernel, which refuses it
        # in its turn.
        for t in (node, *node.src):
            if t is not None and t.buffer is not None:
                try:
                    mem.raw(t)
                except ExecutorError:
                    pass
        steps.append((fn, None, node))
        generic = True
    # Only nodes that run write: a VIEW or RESHAPE of a weight (a node too) leaves the weight's buffer alone.
    written = frozenset(buffer_key(node.buffer) for _fn, _args, node in steps if node.buffer is not None)
    return Plan(steps, mem, generic, written)


def execute(nodes: Sequence[GraphTensor]) -> None:
    """Run ``nodes`` in order, writing each result into the node's own memory."""
    prepare(nodes).run()
