"""Helpers over an example's transcript (per connection, the bytes each side wrote): the connection that failed,
and its requests grouped with their replies."""

from __future__ import annotations

from .findings import Writes


def culprit(transcript: list[Writes]) -> int | None:
    """Index of the connection that failed: the last one that sent more than its opening message."""
    busy = [i for i, c in enumerate(transcript) if sum(1 for sent, _ in c if sent) > 1]
    if busy:
        return busy[-1]
    some = [i for i, c in enumerate(transcript) if c]
    return some[-1] if some else None


def request_groups(writes: Writes) -> list[Writes]:
    """Requests with their replies: each group is one client write and the server writes that follow it."""
    groups: list[Writes] = []
    for sent, raw in writes:
        if sent or not groups:
            groups.append([(sent, raw)])
        else:
            groups[-1].append((sent, raw))
    return groups


def flatten(groups: list) -> Writes:
    return [w for g in groups for w in g]


__all__ = ["culprit", "flatten", "request_groups"]
