"""Fuzzing any ggml RPC server against the reference server's own logic (``ggml-rpc fuzz``).

* :mod:`.valid_requests` and :mod:`.nearvalid`: requests derived from the spec's payload schemas -- valid ones steered
  towards the server's state, and near-valid ones with exactly one flaw;
* :mod:`.oracle`: the oracle, the reference server's per-connection dispatcher run in-process;
* :mod:`.machine`: the hypothesis state machine (bundles of connections, buffers, tensors; a rule per command);
* :mod:`.example` (with :mod:`.steps` and :mod:`.replies`) and :mod:`.campaign` (with :mod:`.saving`):
  invariants, findings, shrinking rounds, budgets, target restarts;
* :mod:`.hunt` (with :mod:`.hunt_strategies`, :mod:`.transcripts`, :mod:`.reports`): the campaign for a target that
  dies often, its strategies aimed at known classes, delta debugging, findings.json and SARIF;
* :mod:`.targets`: the embedded target, spawned targets (with a hash cache the model can follow), what the model
  can know of a target's cache;
* :mod:`.findings`: reproducers (pcap + one-line summary) that ``ggml-rpc replay`` re-runs.
"""

from .campaign import BudgetSpent, Campaign, Options, Stats, TargetGone
from .findings import FuzzFinding, SavedFinding
from .setup import TargetFacts, embedded_campaign, learn_target, target_campaign
from .targets import (
    FUZZ_DEVICE_MEMORY,
    CachedSpawnedTarget,
    EmbeddedFuzzTarget,
    FuzzSpawnedTarget,
    fuzz_config,
    spawned_target,
)

__all__ = [
    "FUZZ_DEVICE_MEMORY",
    "BudgetSpent",
    "CachedSpawnedTarget",
    "Campaign",
    "EmbeddedFuzzTarget",
    "FuzzFinding",
    "FuzzSpawnedTarget",
    "Options",
    "SavedFinding",
    "Stats",
    "TargetFacts",
    "TargetGone",
    "embedded_campaign",
    "fuzz_config",
    "learn_target",
    "spawned_target",
    "target_campaign",
]
