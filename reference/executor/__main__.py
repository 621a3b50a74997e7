"""``python -m ggml_rpc.reference.executor`` prints the supported ops x types table (reference/OPS.md).

``--record FILE`` first merges the OPS-* rows of a ``ggml-rpc interop --json FILE`` result into
reference/op_counts.json, the test-backend-ops counts the table shows beside each op.
"""

import argparse
import json
import sys
from pathlib import Path

from . import counts, render_ops_table

parser = argparse.ArgumentParser(prog="python -m ggml_rpc.reference.executor")
parser.add_argument("--record", metavar="FILE", action="append", default=[],
                    help="merge this `ggml-rpc interop --rows 'OPS*' --json` result into reference/op_counts.json")
args = parser.parse_args()
data = counts.load()
for path in args.record:
    data, measured = counts.record(data, json.loads(Path(path).read_text(encoding="utf-8")))
    print(f"{path}: recorded {len(measured)} ops", file=sys.stderr)
if args.record:
    counts.COUNTS_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
print(render_ops_table(data), end="")
