"""Fixtures of the fuzzer tests: the tests folder on the import path (the vulnerable server variant lives here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
