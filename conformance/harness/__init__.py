"""The conformance harness: checks as data, the targets they run against, the runner, and its reports.

:mod:`.model` declares checks and their verdicts, :mod:`.targets` the servers under test (external, embedded) and
:mod:`.spawned` a spawned one, :mod:`.context` what a check function gets and may raise, :mod:`.runner` the run itself;
:mod:`.report` draws the terminal tables and :mod:`.report_files` writes the JSON and JUnit files.

This package's namespace is the API checks are written against (``from ggml_rpc.conformance.harness import
Category, Context, Level``), so a check does not depend on which module of the harness defines a name (``Level``
is the spec's own, :class:`ggml_rpc.spec.rules.Level`).
"""

from ggml_rpc.spec.rules import Level

from .context import (
    DEFAULT_SEED,
    Blocked,
    CheckFailed,
    Context,
    Evidence,
    RunFacts,
    ServerGone,
    ServerInfo,
    Skipped,
    Unsupported,
    hexdump,
    verdict_for,
)
from .model import SPEC_DOC, Category, Check, Outcome, Result, iter_groups, select
from .runner import ProgressFn, Runner
from .spawned import SpawnedTarget
from .targets import (
    EmbeddedTarget,
    ExternalTarget,
    Target,
    TargetError,
    exit_status,
    format_address,
    free_port,
    parse_address,
    wait_for_port,
)
from .verdict import PROFILES, Profile

__all__ = [
    "DEFAULT_SEED", "PROFILES", "SPEC_DOC", "Blocked", "Category", "Check", "CheckFailed", "Context",
    "EmbeddedTarget", "Evidence", "ExternalTarget", "Level", "Outcome", "Profile", "ProgressFn", "Result", "RunFacts",
    "Runner", "ServerGone", "ServerInfo", "Skipped", "SpawnedTarget", "Target", "TargetError", "Unsupported",
    "exit_status", "format_address", "free_port", "hexdump", "iter_groups", "parse_address", "select", "verdict_for",
    "wait_for_port",
]
