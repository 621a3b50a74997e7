"""The conformance kit: the ``ggml-rpc`` command line (:mod:`.cli`), the kit's client (:mod:`.client`), the
conformance harness (:mod:`.harness`) and its checks (:mod:`.checks`), captured and live sessions (:mod:`.sessions`),
the fuzzer (:mod:`.fuzz`), the Wireshark dissector (:mod:`.dissector`), the benchmarks (:mod:`.bench`) and the
genuine upstream peers (:mod:`.upstream`)."""


def kit_version() -> str:
    """The installed kit's version ("unknown" when running from a checkout without an install)."""
    from importlib import metadata

    try:
        return metadata.version("ggml-rpc-kit")
    except metadata.PackageNotFoundError:
        return "unknown"
