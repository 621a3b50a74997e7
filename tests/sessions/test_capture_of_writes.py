"""``capture_of_writes``: a session decoded as the pcap ``write_session`` would make of it decodes, without the file.

The hunt replays every shrinking candidate this way; the transcripts here are the hunt's own (its examples against
the embedded reference), each also as a client that leaves before its last reply.
"""

from __future__ import annotations

from typing import Any

import pytest
from ggml_rpc.conformance.fuzz import Options
from ggml_rpc.conformance.fuzz.hunt import Hunt, embedded_hunt
from ggml_rpc.conformance.sessions.decode import DecodedConnection, summarize
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.conformance.sessions.replay_captures import (
    capture_of_writes,
    cut_at,
    left_before_reply,
    load_captures,
)
from ggml_rpc.spec import V7, V8


class Recording(Hunt):
    """A hunt that keeps every example's transcript (one list of writes per connection)."""

    transcripts: list[list[list]]

    def _close_example(self) -> None:
        ex = self._example
        if ex is not None and ex.transcript and ex.transcript not in self.transcripts:
            self.transcripts.append([list(w) for w in ex.transcript])
        super()._close_example()


def transcripts(protocol, examples: int) -> list[list[list]]:
    hunt = embedded_hunt(protocol, Options(examples=examples, seed=5, steps=8))
    hunt.__class__ = Recording
    hunt.transcripts = []
    hunt.target.start()
    try:
        hunt.run()
    finally:
        hunt.target.stop()
    assert hunt.transcripts
    return hunt.transcripts


def decoded(dc: DecodedConnection) -> dict[str, Any]:
    return {"protocol": dc.protocol.label if dc.protocol else None, "error": str(dc.error) if dc.error else None,
            "error_direction": dc.error_direction, "notes": dc.notes, "cuts": [repr(c) for c in dc.cuts],
            "messages": [summarize(m) for m in dc.messages()], "left": left_before_reply(dc), "cut_at": cut_at(dc),
            "fin": (dc.conn.c2s.fin, dc.conn.s2c.fin), "rst": (dc.conn.c2s.rst, dc.conn.s2c.rst),
            "sizes": (dc.conn.c2s.size, dc.conn.s2c.size), "link": dc.link}


@pytest.mark.parametrize("protocol", [V7, V8], ids=lambda p: p.label)
def test_a_session_in_memory_decodes_as_its_pcap(protocol, tmp_path):
    for number, session in enumerate(transcripts(protocol, 6)):
        for early in ((), range(len(session))):
            pcap = tmp_path / f"{number}-{bool(early)}.pcap"
            write_session(pcap, session, early=early)
            (from_file,) = load_captures([pcap])
            in_memory = capture_of_writes(session, early=early)
            assert [decoded(dc) for dc in in_memory.connections] == [decoded(dc) for dc in from_file.connections]
