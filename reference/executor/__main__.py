"""``python -m ggml_rpc.reference.executor`` prints the supported ops x types table (reference/OPS.md)."""

from . import render_ops_table

print(render_ops_table(), end="")
