"""Benchmarks, in one place: the measurements behind ``ggml-rpc bench`` -- :mod:`.runner` (interleaved samples,
statistics, the JSON record), :mod:`.server_figures` (what a server does on the wire), :mod:`.kit` (the kit's own
decoding, pcap writing and replay), :mod:`.report` (tables and progress), :mod:`.large_capture` (a synthetic
capture of about 1 GB), :mod:`.scale` and :mod:`.scale_report` (genuine sessions of real size, for
``bench_scale.py``) -- and, beside them, the standalone ``bench_*.py`` scripts run as ``python bench/NAME.py``
for figures the command does not take (resident memory, executor kernels, fuzz rate).  It sits above
``ggml_rpc.conformance`` (it measures the client, the sessions and the servers); nothing below imports it."""
