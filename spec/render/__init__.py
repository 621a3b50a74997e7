"""The renderers of the spec, together: each walks the spec's tables (the versions' Structs, the enums, the rule
table) and writes them in another form, knowing nothing the tables do not say.

- :mod:`.markdown` renders PROTOCOL.md (``ggml-rpc spec``), with :mod:`.markdown_rows` (field tables),
  :mod:`.markdown_tables` (enums, ops, quantisation blocks) and :mod:`.markdown_sections` (the rule table, the
  servers' link).
- :mod:`.lua_source` renders the Wireshark/tshark Lua dissector (``ggml-rpc dissector``): tables from
  :mod:`.lua_tables` on top of the fixed Lua runtime (``runtime.lua``, read by :mod:`.lua_runtime`).
"""
