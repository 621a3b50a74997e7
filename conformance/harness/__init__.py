"""The conformance harness: checks as data, the targets they run against, the runner, and its reports.

This package's namespace is the API a check is written against (``from ggml_rpc.conformance.harness import
Category, Context, Level``); the names live in :mod:`.runner`.  :mod:`.report` draws the terminal tables,
:mod:`.report_files` writes the JSON and JUnit files.
"""

from .runner import (
    SPEC_DOC,
    Category,
    Check,
    CheckFailed,
    Context,
    EmbeddedTarget,
    Evidence,
    ExternalTarget,
    Level,
    Outcome,
    ProgressFn,
    Result,
    Runner,
    ServerGone,
    ServerInfo,
    Skipped,
    SpawnedTarget,
    Target,
    TargetError,
    Unsupported,
    exit_status,
    format_address,
    free_port,
    hexdump,
    iter_groups,
    parse_address,
    select,
    verdict_for,
    wait_for_port,
)

__all__ = [
    "SPEC_DOC", "Category", "Check", "CheckFailed", "Context", "EmbeddedTarget", "Evidence", "ExternalTarget",
    "Level", "Outcome", "ProgressFn", "Result", "Runner", "ServerGone", "ServerInfo", "Skipped", "SpawnedTarget",
    "Target", "TargetError", "Unsupported", "exit_status", "format_address", "free_port", "hexdump", "iter_groups",
    "parse_address", "select", "verdict_for", "wait_for_port",
]
