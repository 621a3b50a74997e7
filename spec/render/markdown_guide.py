"""The sections of the protocol reference that say how the layouts are used: a tensor's shape and ``nbytes``, a
session from HELLO to a result, computing a graph, how refusals show, the hash (see
:mod:`~ggml_rpc.spec.render.markdown`, which places them).

What an implementer cannot read off a field table lives here, written once.  Every number comes from the spec's
tables and functions (type geometry, flags, ops, the FNV constants, :func:`~ggml_rpc.spec.facts.ggml_nbytes`,
:func:`~ggml_rpc.spec.facts.contiguous_strides`), and the worked examples are computed by them (request sizes by
the encoder), so the prose cannot drift from what the kit does with genuine servers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..enums import EMPTY_OPS, TYPES, Command, GgmlOp, TensorFlag, op_name
from ..facts import (
    CONN_CAPS_SIZE,
    FNV_OFFSET_BASIS,
    FNV_PRIME,
    cache_file_name,
    contiguous_strides,
    fnv1a64,
    ggml_nbytes,
)
from ..messages import NO_REPLY
from ..payloads import REQUEST_HEADER, encode_request
from ..tensor import GGML_MAX_DIMS, make_tensor, tensor_name
from ..versions import Protocol
from .markdown_tables import anchor

_F32, _F16, _Q4_0, _Q4_K = (next(t.id for t in TYPES.values() if t.name == n) for n in ("F32", "F16", "Q4_0", "Q4_K"))
_COMPUTE = int(TensorFlag.COMPUTE)


def _type(type_id: int) -> str:
    t = TYPES[type_id]
    return f"{t.name} (blck {t.blck}, size {t.size})"


def _dims(values: Sequence[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


# ---- shapes ------------------------------------------------------------------------------------------------------

#: Worked examples of the shape rules: (type, ne, nb or None for the contiguous strides, what it shows).
_SHAPE_EXAMPLES: tuple[tuple[int, tuple[int, ...], tuple[int, ...] | None, str], ...] = (
    (_F32, (16, 1, 1, 1), None, "a vector of 16: unused dimensions are 1"),
    (_F32, (4, 2, 1, 1), None, "a 4 x 2 matrix: 2 rows of 4"),
    (_F32, (2, 4, 1, 1), (16, 4, 32, 32), "the transpose of the matrix above, a view of the same 32 bytes"),
    (_F16, (3, 5, 1, 1), None, "a 3 x 5 F16 matrix"),
    (_Q4_0, (64, 2, 1, 1), None, "2 rows of 64 Q4_0 elements: 2 blocks of 18 bytes per row"),
    (_Q4_K, (256, 3, 1, 1), None, "3 rows of one 256-element Q4_K super-block each"),
    (_F32, (16, 0, 0, 0), (4, 64, 64, 64), "NOT a vector of 16: a 0 in ne makes the tensor empty"),
)


def shapes_section() -> str:
    """``#tensor-shape`` and ``#nbytes``: what ``ne``/``nb`` mean and the byte extent every bounds check uses."""
    out = [anchor("tensor-shape"), "## Tensors: shape, strides and nbytes\n\n"]
    out.append(
        f"A tensor has {GGML_MAX_DIMS} dimensions. `ne[i]` is its number of elements along dimension i (`ne[0]` is "
        "the innermost: the elements of one row); a tensor of fewer dimensions sets every unused `ne` to **1**, "
        "never 0: a 0 anywhere in `ne` makes the tensor empty (0 elements, [nbytes](#nbytes) 0). `nb[i]` is the "
        "distance in bytes from one element (i = 0) or one row, plane, ... (i ≥ 1) to the next along dimension "
        "i. `type` names the element type; a [type](#enum-types) stores `blck` elements in `size` bytes (`blck` "
        "= 1 for the plain types, 32 or 256 or ... for the quantised ones, whose blocks are laid out as in "
        "[block layouts](#blocks)); the `ne[0]` of a quantised tensor is a multiple of its `blck`.\n\n"
        "A **contiguous** tensor (what ggml creates, and what a client sends for any tensor that is not a view) "
        "has:\n\n"
        "- `nb[0]` = `size` (the type size: the bytes of one element, or of one block);\n"
        "- `nb[1]` = `size` × `ne[0]` / `blck` (the bytes of one row);\n"
        "- `nb[i]` = `nb[i−1]` × `ne[i−1]` for i = 2, 3.\n\n"
        "Other strides describe views (a transpose, a permutation, a slice of rows) of memory that another tensor "
        "owns; servers trust strides as sent.\n\n"
    )
    out.append(anchor("nbytes"))
    out.append(
        "### nbytes\n\n"
        "`nbytes` is ggml's byte extent of a tensor, from its first byte to its last: **every bounds check of every "
        "server uses it** (a tensor's place in its buffer, [REGION-PAST-TENSOR](#rules), ROWS-PAST-TENSOR, "
        "COPY_TENSOR's `nbytes(src)`, MEMSET_TENSOR), computed from `type`, `ne` and `nb` as sent:\n\n"
        "- if any `ne[i]` is 0: 0;\n"
        "- if `blck` = 1: `size` + Σ over i = 0..3 of (`ne[i]` − 1) × `nb[i]`;\n"
        "- otherwise: `ne[0]` × `nb[0]` / `blck` + Σ over i = 1..3 of (`ne[i]` − 1) × `nb[i]`.\n\n"
        "For a contiguous tensor this is `ne[0]` × `ne[1]` × `ne[2]` × `ne[3]` × `size` / `blck`. A dimension "
        "whose `ne` is 1 adds nothing, whatever its `nb`.\n\n"
        "| type | ne | nb | nbytes | what it shows |\n|---|---|---|---|---|\n"
    )
    for type_id, ne, nb, what in _SHAPE_EXAMPLES:
        strides = list(nb) if nb is not None else contiguous_strides(type_id, ne)
        out.append(f"| {_type(type_id)} | `{_dims(ne)}` | `{_dims(strides)}` | {ggml_nbytes(type_id, ne, strides)} "
                   f"| {what} |\n")
    out.append(
        "\nThe last row is a mistake seen in practice: a 16-element vector written as `ne = {16, 0, 0, 0}` has "
        "nbytes 0, so a SET_TENSOR of its 64 bytes lies past the tensor (REGION-PAST-TENSOR), which 6.0.0 and "
        "7.0.0 servers answer by aborting the whole process.\n\n"
    )
    return "".join(out)


# ---- a session ---------------------------------------------------------------------------------------------------


def session_section(command_anchor: Callable[[Command], str]) -> str:
    """``#session``, ``#hello-caps``, ``#alignment``: the commands a client sends to get a result, in order."""
    link = {c: f"[{c.name}](#{command_anchor(c)})" for c in Command if c is not Command.NONE}
    out = [anchor("session"), "## A session, from HELLO to a result\n\n"]
    out.append(
        "The commands a client sends to compute something, in order (each links to its layout in the newest "
        "version of this document):\n\n"
        f"1. {link[Command.HELLO]} with the client's caps; check the reply's version (below).\n"
        f"2. {link[Command.GET_ALIGNMENT]} of device 0 (devices are 0 .. {link[Command.DEVICE_COUNT]} − 1).\n"
        f"3. {link[Command.ALLOC_BUFFER]} of enough bytes for every tensor, each rounded up to the alignment; a "
        "`remote_ptr` of 0 means the server could not allocate.\n"
        f"4. {link[Command.BUFFER_GET_BASE]}: the address of the buffer's first byte. Place each tensor: `buffer` "
        "= `remote_ptr`, `data` = base + its offset (see [alignment](#alignment)).\n"
        f"5. {link[Command.SET_TENSOR]} of each input's bytes.\n"
        f"6. {link[Command.GRAPH_COMPUTE]} of the graph, as [computing a graph](#compute) says.\n"
        f"7. {link[Command.GET_TENSOR]} of each result: the reply is its bytes.\n"
        f"8. {link[Command.FREE_BUFFER]} when done (closing the connection frees every buffer of the "
        "connection too).\n\n"
    )
    out.append(anchor("hello-caps"))
    out.append(
        "### HELLO: caps and versions\n\n"
        f"The request's `conn_caps` are the client's {CONN_CAPS_SIZE} capability bytes. A client over plain TCP "
        f"sends {CONN_CAPS_SIZE} zero bytes, as genuine clients built without RDMA do; non-zero caps ask a server "
        "built with RDMA support to switch the connection to RDMA after its reply. Over plain TCP the server "
        "answers zero caps too.\n\n"
        "The server never checks the client's version: the request carries none, and it answers with its own. "
        "The check is the client's: the reply's `major` must equal the version the client speaks (every major "
        "changes the wire, see the Changes sections), and genuine clients also refuse a server whose `minor` is "
        "newer than theirs. A client that goes on with another major sends layouts the server misreads.\n\n"
    )
    out.append(anchor("alignment"))
    out.append(
        "### Placing tensors: alignment\n\n"
        "`data` is an absolute address on the server: the buffer's base plus the tensor's offset in the buffer, "
        "and `[data, data + nbytes)` must lie inside `[base, base + remote_size]` for every tensor that names a "
        "buffer (otherwise 8.0.0 closes the connection; 6.0.0 and 7.0.0 abort). Servers do not check that `data` "
        "is aligned, but genuine clients place every tensor at an offset from the base that is a multiple of "
        "GET_ALIGNMENT's answer (ggml's allocator does), so that is the placement every backend is exercised "
        "with: a client should do the same. The CPU backends of the covered builds (6.0.0, 7.0.0 and 8.0.0) answer "
        "32.\n\n"
    )
    return "".join(out)


# ---- computing a graph -------------------------------------------------------------------------------------------


def _example_graph() -> tuple[list[dict], list[int]]:
    """The worked example: c = a + b of two 4 x 2 F32 matrices placed one after the other from the base."""
    ne = (4, 2, 1, 1)
    size = ggml_nbytes(_F32, ne, contiguous_strides(_F32, ne))
    a = make_tensor(id=1, type=_F32, ne=ne, buffer=1, data=0, name="a")
    b = make_tensor(id=2, type=_F32, ne=ne, buffer=1, data=size, name="b")
    c = make_tensor(id=3, type=_F32, ne=ne, buffer=1, data=2 * size, op=int(GgmlOp.ADD), src=[1, 2],
                    flags=_COMPUTE, name="c")
    return [a, b, c], [3]


def _graph_fields(protocol: Protocol, tensors: list[dict], nodes: list[int]) -> dict:
    fields: dict = {"device": 0, "n_nodes": len(nodes), "nodes": nodes, "n_tensors": len(tensors),
                    "tensors": tensors}
    if protocol.graph_cache_max is not None:
        fields["uid"] = 1
    return fields


def compute_section(versions: Sequence[Protocol], command_anchor: Callable[[Protocol, Command], str]) -> str:
    """``#compute``: what a client must do to get a result out of GRAPH_COMPUTE, with a worked example."""
    newest = versions[-1]
    gc, gt = (f"[{c.name}](#{command_anchor(newest, c)})" for c in (Command.GRAPH_COMPUTE, Command.GET_TENSOR))
    empty = ", ".join(f"{op_name(op)} ({int(op)})" for op in sorted(EMPTY_OPS))
    out = [anchor("compute"), "## Computing a graph\n\n"]
    out.append(
        f"{gc} sends a graph: the ids of the nodes to run, in order, and the rpc_tensor of every tensor they "
        f"involve. It has no reply; results are read back with {gt}. To get a result:\n\n"
        "1. **Give every tensor memory**, inputs and results alike: `buffer` and `data` inside an allocated "
        "buffer (see [a session](#session)). A tensor without a buffer must have `data` 0, and is only good as "
        "a shape: a node that has no memory cannot be computed into.\n"
        "2. **Write the inputs** with SET_TENSOR. An input (a *leaf*) has `op` NONE (0) and needs no flag.\n"
        "3. **Describe each node** (a tensor computed by the graph): `op` = its [ggml op](#enum-ops), `src[k]` "
        "= the ids of its operands in the op's order (0 = none), `op_params` as the op needs them "
        "([op_params](#op-params); zeros for an op not listed there), `type`/`ne`/`nb` of the result, and "
        "**`flags` with COMPUTE "
        f"({_COMPUTE}) set**. Every covered server skips a node without COMPUTE silently: the GRAPH_COMPUTE is "
        "accepted, nothing is computed, and the node's memory keeps whatever it held (ggml sets the flag on "
        "every node it builds into a graph; the RPC client sends flags unchanged).\n"
        "4. **Send GRAPH_COMPUTE**: `nodes` = the node ids in execution order (a node after every node it "
        "reads), `n_nodes` their number (at least 1, no id 0); `tensors` = one rpc_tensor for each node **and** "
        "for every tensor reachable from the nodes through `src` and `view_src`, `n_tensors` their number. The "
        "server looks every id up among `tensors`, whose order does not matter (the first of two entries with "
        "one id wins); an id it cannot find closes the connection. Leaves are not nodes: a node of op NONE "
        "computes nothing.\n"
        f"5. **Read the result** with {gt} of the node's tensor (offset 0, `nbytes` bytes). Replies come in "
        "order, so this reply also says that everything before it was accepted: a refused GRAPH_COMPUTE closes "
        "the connection instead (see [failures](#failures)). 8.0.0 computes graphs asynchronously; a command that "
        "reads or writes buffer data waits for them, so the GET_TENSOR reply holds the result.\n\n"
        f"Nodes of the ops {empty} compute nothing: they only describe memory that another tensor owns (a view: "
        "`view_src` = that tensor's id, `view_offs` = the byte offset into it, `data` = the view's own "
        "address). Nor is anything computed for a node with a 0 in `ne`.\n\n"
        "`use_count`: the server hands each node's count to the backend, and the CPU backend of every covered "
        "build reads it: an RMS_NORM node followed directly by a MUL that reads it is fused "
        "into one step when the RMS_NORM's `use_count` is 1 (and it is not flagged OUTPUT (2) nor a view), and "
        "then the RMS_NORM's own tensor is not written. Send ggml's count (the number of `src` entries of the "
        "graph's nodes that name the tensor) or 0, which never fuses; it is 0 in every other request.\n\n"
    )
    out.append(anchor("compute-example"))
    tensors, nodes = _example_graph()
    a, _, c = tensors
    out.append(
        "### Example: one ADD\n\n"
        "c = a + b for two 4 x 2 F32 matrices placed one after another from the buffer's base (`data` shown "
        "as an offset from the base: add the base on the wire; `buffer` is the ALLOC_BUFFER handle). Every field "
        "not shown is 0, `name` included (it is only a label).\n\n"
        "| tensor | id | type | ne | nb | op | flags | src | data |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    for t in tensors:
        src = ", ".join(str(s) for s in t["src"] if s) or "—"
        op = f"{op_name(t['op'])} ({t['op']})"
        out.append(f"| {tensor_name(t['name'])} | {t['id']} | {TYPES[t['type']].name} ({t['type']}) | "
                   f"`{_dims(t['ne'])}` | `{_dims(t['nb'])}` | {op} | {t['flags']} | {src} | base + {t['data']} |\n")
    by_size: dict[int, list[str]] = {}
    for p in versions:
        payload = len(encode_request(p, Command.GRAPH_COMPUTE, _graph_fields(p, tensors, nodes))) - REQUEST_HEADER.size
        by_size.setdefault(payload, []).append(p.label + (", with its `uid`" if p.graph_cache_max is not None else ""))
    sizes = "; ".join(f"{n} bytes ({', '.join(labels)})" for n, labels in by_size.items())
    size_c, size_a = (ggml_nbytes(t["type"], t["ne"], t["nb"]) for t in (c, a))
    out.append(
        f"\nThe GRAPH_COMPUTE carries `nodes` = [{c['id']}] (`n_nodes` 1) and the three tensors (`n_tensors` 3, "
        f"any order): a payload of {sizes}. A GET_TENSOR of c at offset 0 for {size_c} bytes then returns the "
        f"8 sums. a and b are written first with SET_TENSOR ({size_a} bytes each); without flags = {_COMPUTE} on c "
        "the same exchange returns c's old bytes.\n\n"
    )
    return "".join(out)


# ---- failures ----------------------------------------------------------------------------------------------------


def failures_section(versions: Sequence[Protocol]) -> str:
    """``#failures``: there is no error reply; how a refusal shows, and how a client learns of one."""
    no_reply = sorted({spec.command.name for p in versions for spec in p.commands.values() if spec.reply is NO_REPLY})
    out = [anchor("failures"), "## Failures: how a refusal shows\n\n"]
    out.append(
        "There is no error reply. A server that refuses a request **closes the connection** without sending "
        "anything more (each command's section and the [rules](#rules) say when); on some malformed requests "
        "every covered build aborts instead, ending the whole process (6.0.0 and 7.0.0 on more of them than "
        "8.0.0, which closes where they abort on a tensor outside its buffer). The only replies that say no in "
        "band are ALLOC_BUFFER's `remote_ptr` 0, SET_TENSOR_HASH's `result` 0 (not in the cache), COPY_TENSOR's "
        "`result` 0 (the backend declined), 7.0.1's GET_DEVICE_SUPPORTS_OP 0 and 8.0.0's COMM_INIT `ok` 0.\n\n"
        f"Commands without a reply ({', '.join(no_reply)}) are therefore refused silently: the client learns of "
        "it only when its next command that has a reply gets end-of-stream (or a reset) instead of the reply. To "
        "know that a run of them was accepted, follow it with a command that has a reply (a GET_TENSOR of the "
        "result, or GET_ALIGNMENT when there is nothing to read) and wait for that reply. A client must not wait "
        "for a reply to a command that has none: none comes, and the stream is out of step from then on.\n\n"
    )
    return "".join(out)


# ---- the hash ----------------------------------------------------------------------------------------------------

_HASH_VECTORS = (b"", b"a", b"foobar")


def hash_section() -> str:
    """``#hash``: the FNV-1a-64 of SET_TENSOR_HASH and of the servers' cache, with its constants and test vectors."""
    out = [anchor("hash"), "## The hash (FNV-1a, 64-bit)\n\n"]
    out.append(
        "SET_TENSOR_HASH's `hash` and the name of a server's cache entry are the 64-bit FNV-1a of exactly the "
        "bytes a SET_TENSOR would carry as its data (not the tensor, the offset nor the cache flag): start from "
        f"the offset basis h = `{FNV_OFFSET_BASIS:#018x}`; for each byte b in order, h = (h XOR b) × "
        f"`{FNV_PRIME:#x}` (the FNV prime), modulo 2^64. A cache entry is a file named by h as 16 lowercase hex "
        "digits that holds those bytes.\n\n| data | hash | cache file name |\n|---|---|---|\n"
    )
    for data in _HASH_VECTORS:
        h = fnv1a64(data)
        shown = f'`"{data.decode()}"`' if data else "(no bytes)"
        out.append(f"| {shown} | `{h:#018x}` | `{cache_file_name(h)}` |\n")
    return "".join(out) + "\n"
