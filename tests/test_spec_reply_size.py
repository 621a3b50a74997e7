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
            assert spec.reply_size({"size": 12345}) == 12345
        else:
            assert spec.reply_size({}) == spec.reply.schema.sizeof()
    assert protocol.commands[Command.HELLO].reply_size({}) == 28
    assert protocol.commands[Command.ALLOC_BUFFER].reply_size({}) == 16
