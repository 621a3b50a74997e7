"""CommandSpec.reply_size: the one rule for how long a reply is, derived from the reply payload's shape."""

from __future__ import annotations

import pytest
from ggml_rpc.spec import PROTOCOLS, Command, Shape


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.label)
def test_reply_sizes_follow_the_tables(protocol):
    for cmd, spec in protocol.commands.items():
        if not spec.has_reply:
            with pytest.raises(ValueError, match=cmd.name):
                spec.reply_size({})
        elif spec.reply.shape is Shape.RAW:
            fields = {"size": 12345, "n_copies": 3}
            expected = 12345 * (3 if "n_copies" in spec.reply.length_from else 1)
            assert spec.reply_size(fields) == expected
        else:
            assert spec.reply_size({}) == spec.reply.schema.sizeof()
    assert protocol.commands[Command.HELLO].reply_size({}) == 28
    assert protocol.commands[Command.ALLOC_BUFFER].reply_size({}) == 16
