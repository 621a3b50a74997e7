"""``python -m ggml_rpc.conformance.cli``: the ``ggml-rpc`` command."""

import sys

from ggml_rpc.conformance.cli import main

sys.exit(main())
