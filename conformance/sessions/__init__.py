"""Captured and live sessions: reading pcaps, decoding them, linting, replaying, the recording proxy and scenarios.

:mod:`.capture` reassembles the TCP connections of a pcap, :mod:`.decode` turns them into requests and replies,
:mod:`.lint` checks them against the spec's client and server rules, :mod:`.replay` sends their client side to a
server again, :mod:`.proxy` forwards, records and checks live traffic, :mod:`.pcapwrite` writes TCP sessions as
pcaps and :mod:`.scenarios` holds the named client sessions ``ggml-rpc pcap record`` records.
"""
