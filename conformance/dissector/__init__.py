"""The Wireshark/tshark Lua dissector: :mod:`.lua_source` emits it from the spec tables, on top of the fixed Lua
runtime text in :mod:`.runtime`."""
