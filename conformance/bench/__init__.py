"""``ggml-rpc bench``'s measurements: :mod:`.runner` (interleaved samples, statistics, the JSON record),
:mod:`.wire` (what a server does on the wire), :mod:`.kit` (the kit's own decoding, pcap writing and replay) and
:mod:`.report` (tables and progress)."""
