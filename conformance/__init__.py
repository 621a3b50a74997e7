"""The conformance kit: the ``ggml-rpc`` command line (:mod:`.cli`), the kit's client (:mod:`.client`), the
conformance harness (:mod:`.harness`) and its checks (:mod:`.checks`), captured and live sessions (:mod:`.sessions`),
the fuzzer (:mod:`.fuzz`) and the genuine upstream peers (:mod:`.upstream`).  The renderers of the spec (PROTOCOL.md,
the Wireshark dissector) are :mod:`ggml_rpc.spec.render`; the benchmarks are :mod:`ggml_rpc.bench`."""


def kit_version() -> str:
    """The installed kit's version ("unknown" when running from a checkout without an install)."""
    from importlib import metadata

    try:
        return metadata.version("ggml-rpc-kit")
    except metadata.PackageNotFoundError:
        return "unknown"
