"""The fixed part of the generated Lua dissector: reassembly, conversation state, the generic layout walker.

It names no command and no field: everything protocol-specific comes from the tables that
:func:`ggml_rpc.spec.render.lua_source.generate` emits above it (``F``, ``HF``, ``LAYOUTS``, ``PAYLOADS``,
``PROTOCOLS``, ``TYPES``, ``C``, ``R`` and the value strings).  The only facts used here are the framing (command byte
and size header, replies in request order) and the arithmetic of the rule table's stateless rules
(:mod:`ggml_rpc.spec.rules`): which commands have which tensors, regions, copies and rows, and each rule's id, come
from ``R``; the 64-bit bounds, the row span and the graph rules (array membership) are logic and stay in Lua.

Bulk data (SET_TENSOR data, GET_TENSOR replies) is never reassembled: once the fixed part of such a message has
arrived, the remaining bytes of the direction are counted down segment by segment ("continuation").  Wireshark
dissects a frame more than once (first pass, then again with ``pinfo.visited``), so the first pass stores what it
found per frame and later passes only render it.
"""

from importlib.resources import files

#: The runtime's Lua text, kept as a Lua file beside this module (read once, when the generator is imported).
RUNTIME = "\n" + files(__package__).joinpath("runtime.lua").read_text(encoding="utf-8")
