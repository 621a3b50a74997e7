"""The Wireshark/tshark Lua dissector: :mod:`.generate` emits it from the spec tables, on top of the fixed Lua
runtime text in :mod:`.runtime`."""
