"""Captured and live sessions: reading pcaps, decoding them, linting, replaying, the recording proxy and scenarios.

:mod:`.capture` reassembles the TCP connections of a pcap and :mod:`.decode` turns them into requests and replies;
:mod:`.lint` checks them against the spec's client and server rules; :mod:`.replay` sends their client side to a
server again, comparing the replies by class (:mod:`.compare`) and relocating server-assigned values
(:mod:`.relocate`); :mod:`.proxy` forwards, records and checks live traffic, framed as it streams through by
:mod:`.stream_checker`; :mod:`.pcapwrite` writes TCP sessions as pcaps; :mod:`.scenarios` holds the named client
sessions that :mod:`.recording` records (``ggml-rpc pcap record``).
"""
