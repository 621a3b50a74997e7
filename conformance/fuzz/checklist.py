"""The security checklist drawn from upstream's reported RPC bugs and from reading its code, item by item: what
aims at it, and what proves the reference safe.

Each item names the near-valid flaw or stateful sequence of the fuzzer that targets it (``strategy``) and the tests
that show the reference server handles it (``tests``, pytest node ids relative to the repository root).  A test of
the kit checks that every item has at least one of the two and that every name given here exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    number: int
    bad_input: str
    #: The fuzzer's near-valid flaw ("kind: field") or stateful sequence that aims at it; None if only tested.
    strategy: str | None
    tests: tuple[str, ...]


_RULES = "tests/reference/test_ref_rules.py"
_CACHE = "tests/reference/test_ref_cache.py"
_MINE = "tests/fuzz/test_security_checklist.py"

CHECKLIST: tuple[Item, ...] = (
    Item(1, "tensor data outside its buffer (SET/GET_TENSOR, graphs)", "bound: tensor.data",
         (f"{_RULES}::test_data_outside_its_buffer_closes",
          "tests/fuzz/test_fuzz_vulnerable.py::test_finds_the_crash_within_an_example_budget")),
    Item(2, "COPY_TENSOR copying more than the room after dst.data", "bound: dst.data",
         (f"{_RULES}::test_copy_tensor_overflowing_dst_buffer_closes",)),
    Item(3, "tensor type >= GGML_TYPE_COUNT", "type: tensor.type",
         (f"{_RULES}::test_invalid_or_removed_type_closes",)),
    Item(4, "a dimension ne[i] = 0", "bound: tensor.ne", (f"{_MINE}::test_zero_dimension_spans_no_bytes",)),
    Item(5, "removed type (block size 0)", "type: tensor.type", (f"{_RULES}::test_invalid_or_removed_type_closes",)),
    Item(6, "graph tensor without buffer but with data", "id: tensors.buffer",
         (f"{_RULES}::test_graph_compute_bad_graph_closes",)),
    Item(7, "host pointers in tensors without an RPC buffer", "id: tensor.buffer",
         (f"{_RULES}::test_get_tensor_without_buffer_closes", f"{_RULES}::test_set_tensor_without_buffer_closes")),
    Item(8, "GRAPH_COMPUTE, FREE_BUFFER of its buffer, GRAPH_RECOMPUTE (use after free)",
         "stateful: FREE_BUFFER and GRAPH_RECOMPUTE rules after GRAPH_COMPUTE on one connection",
         (f"{_RULES}::test_graph_recompute_after_free_buffer_closes", f"{_MINE}::test_recompute_after_free_closes")),
    Item(9, "GRAPH_COMPUTE node id 0", "id: nodes", (f"{_RULES}::test_graph_compute_bad_graph_closes",)),
    Item(10, "quantized type with ne[0] not a multiple of the block size", "bound: tensor.ne",
         (f"{_MINE}::test_quantized_row_not_a_multiple_of_the_block",)),
    Item(11, "CUSTOM / MAP_CUSTOM ops with a function pointer in op_params", "type: tensors.op",
         (f"{_RULES}::test_graph_compute_bad_graph_closes", f"{_MINE}::test_native_callback_ops_never_run")),
    Item(12, "ACC / SET with strides in op_params that leave the destination", None,
         (f"{_MINE}::test_acc_and_set_strides_stay_inside",)),
    Item(13, "SSM_SCAN with out-of-range ids", None, (f"{_MINE}::test_ssm_scan_is_refused_or_bounded",)),
    Item(14, "GET_ROWS / SET_ROWS with mismatched shapes or row ids; ne = 1 dims whose nb escapes nbytes",
         "bound: tensor.nb", (f"{_MINE}::test_get_rows_out_of_range_rows_close",
                              f"{_MINE}::test_stride_of_a_unit_dimension_is_not_a_way_out")),
    Item(15, "crafted GET_ROWS graph", None, (f"{_MINE}::test_get_rows_out_of_range_rows_close",)),
    Item(16, "valid buffer, data outside it, in any tensor-taking command", "bound: tensor.data",
         (f"{_MINE}::test_data_outside_the_buffer_closes_every_tensor_command",)),
    Item(17, "SET/GET_TENSOR inside the buffer but past the tensor's nbytes", "bound: offset",
         (f"{_RULES}::test_set_tensor_past_nbytes_inside_buffer_closes_before_reading",
          f"{_RULES}::test_get_tensor_past_nbytes_closes")),
    Item(18, "GRAPH_COMPUTE whose node fails in the backend", "stateful: GRAPH_COMPUTE of fuzzed graphs",
         (f"{_RULES}::test_graph_backend_failure_closes",)),
    Item(19, "SET_TENSOR / GRAPH_COMPUTE size header huge (>= RAM, >= 2^63)", "size",
         (f"{_RULES}::test_huge_size_claims_close_without_allocating",)),
    Item(20, "very deep src chains", None,
         ("tests/reference/test_ref_graph.py::test_deep_chain_has_no_recursion_limit",
          f"{_MINE}::test_deep_chain_over_the_wire")),
    Item(21, "many cache-flagged SET_TENSORs (disk fill)", "flag: cache_flag",
         (f"{_CACHE}::test_lru_bound_evicts_least_recently_used",
          f"{_CACHE}::test_payload_larger_than_the_cache_bound_is_not_saved")),
    Item(22, "SET_TENSOR_HASH with a garbage tensor when the hash is absent", "id: tensor.buffer",
         (f"{_RULES}::test_set_tensor_hash_without_cache_is_a_miss_without_validation",
          f"{_CACHE}::test_hash_miss_with_a_cache_does_not_validate_the_tensor")),
)
