-- ===================================================================================================== runtime ==
local E = {
  violation = ProtoExpert.new("ggml_rpc.violation", "Spec violation", expert.group.PROTOCOL, expert.severity.ERROR),
  note = ProtoExpert.new("ggml_rpc.note", "ggml RPC note", expert.group.SEQUENCE, expert.severity.NOTE),
  chat = ProtoExpert.new("ggml_rpc.chat", "ggml RPC info", expert.group.SEQUENCE, expert.severity.CHAT),
}
P.experts = { E.violation, E.note, E.chat }

local REQ_FRAME = ProtoField.framenum("ggml_rpc.request_in", "Request in frame", base.NONE)
local REP_FRAME = ProtoField.framenum("ggml_rpc.response_in", "Reply in frame", base.NONE)
local CONT_FRAME = ProtoField.framenum("ggml_rpc.continuation_of", "Message starts in frame", base.NONE)
F[#F + 1] = REQ_FRAME
F[#F + 1] = REP_FRAME
F[#F + 1] = CONT_FRAME
P.fields = F

local f_seq = Field.new("tcp.seq")
local f_len = Field.new("tcp.len")
local skip_bytes

local convs = {}    -- endpoint pair -> conversation state built on the first pass
local results = {}  -- frame/call key -> what the first pass found in that tvb

local seen_pairs = {}  -- connections the heuristic has looked at

function P.init()
  convs = {}
  results = {}
  seen_pairs = {}
end

local PROTOCOL_BY_LABEL = {}
for _, p in ipairs(PROTOCOLS) do PROTOCOL_BY_LABEL[p.label] = p end

-- A command id's name in a version (ids belong to a version), else as 6.0.0-7.0.1 name it.
local function cmd_name(cmd, label)
  local proto = label and PROTOCOL_BY_LABEL[label]
  if proto ~= nil then
    if proto.commands[cmd] ~= nil then return proto.commands[cmd].name end
    if cmd == proto.sentinel then return C.SENTINEL_NAME end
  end
  return VS_CMD[cmd] or ("CMD_" .. tostring(cmd))
end

local function u64_num(v)
  return tonumber(tostring(v))
end

local function protocol_for(major, minor, patch)
  local best = nil
  for _, p in ipairs(PROTOCOLS) do
    if p.major == major and p.minor == minor and p.patch <= patch then best = p end
  end
  return best
end

local function protocol_by_label(label)
  for _, p in ipairs(PROTOCOLS) do
    if p.label == label then return p end
  end
  return nil
end

-- ------------------------------------------------------------------------------------------------ analysis ----

-- Preference: learn the version from each HELLO reply, or force one table (a capture that starts after the
-- handshake has no HELLO to learn it from).
local version_choices = { { 1, "auto", 0 } }
for i, p in ipairs(PROTOCOLS) do version_choices[#version_choices + 1] = { i + 1, p.label, i } end
P.prefs.version = Pref.enum("Protocol version", 0,
  "auto: from each connection's HELLO reply; a version: decode every connection with that table",
  version_choices, false)

local function forced_protocol()
  local i = P.prefs.version
  if i ~= nil and i > 0 then return PROTOCOLS[i] end
  return nil
end

local function new_conv(key)
  local forced = forced_protocol()
  return {
    key = key,
    forced = forced,        -- table chosen in the preferences, if any
    version = forced,       -- protocol table learnt from the HELLO reply (or forced)
    version_error = nil,    -- why no table could be picked
    client = nil,           -- "addr:port" of the side that sends requests
    req = { skip = 0, dead = nil, index = 0, hello = false },
    rep = { skip = 0, dead = nil, first = 1, last = 0, queue = {} },
    req_frames = {},        -- request index -> frame where it was decoded
    rep_frames = {},        -- request index -> frame of its reply
  }
end

-- Field extractors (tcp.stream, tcp.seq) only work when a tree is built, which the first pass may not do: the
-- conversation is therefore keyed by its two endpoints.
local function conv_key(pinfo)
  local a = tostring(pinfo.src) .. ":" .. tostring(pinfo.src_port)
  local b = tostring(pinfo.dst) .. ":" .. tostring(pinfo.dst_port)
  if a < b then return a .. "|" .. b end
  return b .. "|" .. a
end

local function conv_of(pinfo)
  local key = conv_key(pinfo)
  local c = convs[key]
  if c == nil then
    c = new_conv(key)
    convs[key] = c
  end
  return c
end

local function endpoint(addr, port)
  return tostring(addr) .. ":" .. tostring(port)
end

-- A connection whose first bytes are a HELLO request is ggml RPC, whatever its port.  Clients may send the
-- command byte in a segment of its own, so a stream-opening segment that is a prefix of a HELLO header counts.
local function hello_prefix(tvb)
  local n = math.min(tvb:len(), C.REQ_HDR)
  if n == 0 or tvb(0, C.CMD_LEN):uint() ~= C.HELLO then return false end
  for i = 1, n - 1 do
    local want = math.floor(C.HELLO_SIZE / 256 ^ (i - 1)) % 256  -- byte i of the size header
    if tvb(i, 1):uint() ~= want then return false end
  end
  return true
end

local function pick_client(c, tvb, pinfo)
  local src, dst = endpoint(pinfo.src, pinfo.src_port), endpoint(pinfo.dst, pinfo.dst_port)
  if hello_prefix(tvb) then
    c.client = src
  elseif pinfo.match_uint == pinfo.dst_port then
    c.client = src
  elseif pinfo.match_uint == pinfo.src_port then
    c.client = dst
  elseif pinfo.dst_port == C.PORT then
    c.client = src
  elseif pinfo.src_port == C.PORT then
    c.client = dst
  else
    c.client = src
  end
end

-- How much of a message this segment holds, given the bytes the message needs before its bulk data and the bulk's
-- size: the bytes still missing (nil when enough is here), else sets the item's length and bulk counts.
local function place(it, need, bulk, size, avail)
  if C.REASSEMBLE_BULK then need = need + bulk end
  if avail < need then return need - avail end
  local here = C.REASSEMBLE_BULK and bulk or math.min(bulk, avail - need)
  it.len = C.REASSEMBLE_BULK and need or (need + here)
  it.size = size
  it.bulk, it.bulk_here = bulk, here
  return nil
end

-- One request starting at off: returns an item, or nil and the number of bytes still needed.
local function analyse_request(c, d, tvb, off, pinfo)
  local avail = tvb:len() - off
  if avail < C.REQ_HDR then return nil, DESEGMENT_ONE_MORE_SEGMENT end
  local cmd = tvb(off, C.CMD_LEN):uint()
  local size64 = tvb(off + C.CMD_LEN, C.SIZE_LEN):le_uint64()
  local it = { kind = "req", off = off, cmd = cmd, frame = pinfo.number }
  local err = nil
  if not d.hello and cmd ~= C.HELLO and c.forced ~= nil then
    d.hello = true  -- a forced version: the capture may start after the handshake
  end
  if not d.hello then
    if cmd ~= C.HELLO then err = "the first command must be HELLO, got " .. cmd_name(cmd) end
  elseif cmd == C.HELLO then
    err = "HELLO may be sent only once per connection"
  end
  local proto = c.version
  local sentinel = (proto ~= nil and cmd == proto.sentinel) or (proto == nil and C.NEVER_ON_WIRE[cmd])
  if err == nil and sentinel then
    err = "command " .. cmd .. " (" .. C.SENTINEL_NAME .. ") is a client-side sentinel, never sent"
  end
  if proto == nil and cmd == C.HELLO then proto = PROTOCOLS[1] end
  if err == nil and proto == nil then
    err = c.version_error or "protocol version unknown (no HELLO reply seen): cannot decode"
  end
  local spec = proto and proto.commands[cmd]
  if err == nil and spec == nil then
    err = "command id " .. cmd .. " does not exist in protocol " .. proto.label
  end
  local size = nil
  if err == nil then
    local req = spec.request
    if size64 > UInt64(C.MAX_PAYLOAD) then
      err = "size claim " .. tostring(size64) .. " exceeds the limit " .. C.MAX_PAYLOAD
    else
      size = u64_num(size64)
      if req.shape == "FIXED" and size ~= req.size then
        err = "size " .. size .. ", but " .. cmd_name(cmd, proto.label) .. " is always " .. req.size .. " bytes"
      elseif (req.shape == "HEADER_DATA" or req.shape == "GRAPH") and size < req.size then
        err = "size " .. size .. " is below the minimum " .. req.size
      end
    end
  end
  if err ~= nil then
    -- The server closes (or dies) here: nothing after this is a message.
    it.error = err
    it.len = avail
    it.version = proto and proto.label or nil
    d.dead = err
    return it
  end
  local req = spec.request
  local need, bulk
  if req.shape == "FIXED" then
    need, bulk = C.REQ_HDR + size, 0
  elseif req.shape == "HEADER_DATA" then
    need, bulk = C.REQ_HDR + req.size, size - req.size
  elseif size <= C.GRAPH_REASSEMBLE_MAX then
    need, bulk = C.REQ_HDR + size, 0
  else
    need, bulk = C.REQ_HDR + req.size, size - req.size
    it.graph_partial = true
  end
  local missing = place(it, need, bulk, size, avail)
  if missing then return nil, missing end
  it.version = proto.label
  it.version_known = c.version ~= nil
  it.index = d.index
  d.index = d.index + 1
  if cmd == C.HELLO then d.hello = true end
  d.skip = bulk - it.bulk_here
  d.skip_cmd, d.skip_frame = cmd, pinfo.number
  d.skip_end, d.max_end = nil, nil
  c.req_frames[it.index] = pinfo.number
  if spec.reply ~= nil then
    local expected = spec.reply.size
    if spec.reply.shape == "RAW" then
      expected = UInt64(1)
      for _, f in ipairs(spec.reply.length_from) do
        expected = expected * tvb(off + C.REQ_HDR + f[1], f[2]):le_uint64()
      end
    else
      expected = UInt64(expected)
    end
    local q = c.rep
    q.last = q.last + 1
    q.queue[q.last] = { cmd = cmd, index = it.index, frame = pinfo.number, expected = expected, version = proto.label }
  else
    it.no_reply = true
  end
  return it
end

local function analyse_reply(c, d, tvb, off, pinfo)
  local avail = tvb:len() - off
  if avail < C.REP_HDR then return nil, DESEGMENT_ONE_MORE_SEGMENT end
  local size64 = tvb(off, C.SIZE_LEN):le_uint64()
  local head = d.queue[d.first]
  local it = { kind = "rep", off = off, frame = pinfo.number }
  local err = nil
  if head == nil then
    err = "reply bytes arrived while no request awaits a reply"
  else
    it.cmd, it.index, it.req_frame, it.version = head.cmd, head.index, head.frame, head.version
    if size64 ~= head.expected then
      err = "reply size " .. tostring(size64) .. ", expected " .. tostring(head.expected)
    elseif size64 > UInt64(C.MAX_PAYLOAD) then
      err = "reply size claim " .. tostring(size64) .. " exceeds the limit " .. C.MAX_PAYLOAD
    end
  end
  if err ~= nil then
    -- The client aborts here.
    it.error = err
    it.len = avail
    d.dead = err
    return it
  end
  local size = u64_num(size64)
  local reply = protocol_by_label(head.version).commands[head.cmd].reply
  local need, bulk
  if reply.shape == "RAW" then
    need, bulk = C.REP_HDR, size
  else
    need, bulk = C.REP_HDR + size, 0
  end
  local missing = place(it, need, bulk, size, avail)
  if missing then return nil, missing end
  d.queue[d.first] = nil
  d.first = d.first + 1
  d.skip = bulk - it.bulk_here
  d.skip_cmd, d.skip_frame = head.cmd, pinfo.number
  d.skip_end, d.max_end = nil, nil
  c.rep_frames[head.index] = pinfo.number
  if head.cmd == C.HELLO then
    local base = off + C.REP_HDR
    local major = tvb(base + C.HELLO_MAJOR_OFF, C.HELLO_VER_LEN):le_uint()
    local minor = tvb(base + C.HELLO_MINOR_OFF, C.HELLO_VER_LEN):le_uint()
    local patch = tvb(base + C.HELLO_PATCH_OFF, C.HELLO_VER_LEN):le_uint()
    local proto = protocol_for(major, minor, patch)
    it.announced = major .. "." .. minor .. "." .. patch
    if c.forced ~= nil then
      it.picked = c.forced.label .. " (forced in the preferences)"
    elseif proto == nil then
      c.version_error = "server announces " .. it.announced .. ": not covered by this dissector"
      it.version_error = c.version_error
    else
      c.version = proto
      it.picked = proto.label
    end
  end
  return it
end

-- integer literals: exact in every Lua (no float results that would print as "1460.0")
local SEQ_MOD, SEQ_HALF = 4294967296, 2147483648

local function seq_diff(a, b)
  return (a - b + SEQ_HALF) % SEQ_MOD - SEQ_HALF
end

-- How many of the next avail bytes are bulk data of the message in progress.  Counting bytes is exact when
-- segments arrive in order; a whole plain segment (tvb length == tcp.len) also carries its sequence number,
-- which keeps the count right when the capture holds reordered or duplicated segments of the bulk data.
skip_bytes = function(d, avail, whole_len)
  local seq, tlen = f_seq(), f_len()
  if whole_len and seq ~= nil and tlen ~= nil and tlen.value == whole_len and d.skip < SEQ_HALF then
    local start = seq.value
    if d.skip_end == nil then
      d.skip_end = (start + d.skip) % SEQ_MOD
      d.max_end = start
    end
    local stop = (start + whole_len) % SEQ_MOD
    if seq_diff(stop, d.max_end) > 0 then d.max_end = stop end
    local n = math.max(0, math.min(whole_len, seq_diff(d.skip_end, start)))
    d.skip = math.max(0, seq_diff(d.skip_end, d.max_end))
    return n
  end
  local n = math.min(d.skip, avail)
  d.skip = d.skip - n
  if d.max_end ~= nil then d.max_end = (d.max_end + n) % SEQ_MOD end
  return n
end

local function analyse(tvb, pinfo)
  local c = conv_of(pinfo)
  if c.client == nil then pick_client(c, tvb, pinfo) end
  local from_client = endpoint(pinfo.src, pinfo.src_port) == c.client
  local d = from_client and c.req or c.rep
  local res = { items = {}, from_client = from_client, conv = c }
  local off, len = 0, tvb:len()
  while off < len do
    if d.dead ~= nil then
      res.items[#res.items + 1] = { kind = "dead", off = off, len = len - off, why = d.dead }
      break
    end
    if d.skip > 0 then
      local n = skip_bytes(d, len - off, off == 0 and len)
      if n > 0 then
        res.items[#res.items + 1] = { kind = "cont", off = off, len = n, cmd = d.skip_cmd, frame = d.skip_frame,
                                      version = c.version and c.version.label or nil,
                                      left = d.skip }
        off = off + n
      end
    else
      local it, need
      if from_client then
        it, need = analyse_request(c, d, tvb, off, pinfo)
      else
        it, need = analyse_reply(c, d, tvb, off, pinfo)
      end
      if it == nil then
        res.deseg_off, res.deseg_len = off, need
        break
      end
      res.items[#res.items + 1] = it
      off = off + it.len
    end
  end
  return res
end

-- --------------------------------------------------------------------------------------------------- render ----

local function nbytes(t)
  -- ggml_nbytes with the strides as sent; nil for a type outside the table or removed
  local info = TYPES[t.type]
  if info == nil or info.blck == 0 then return nil end
  for i = 1, 4 do
    if t.ne[i] == 0 then return UInt64(0) end
  end
  local total
  if info.blck == 1 then
    total = UInt64(info.size)
    for i = 1, 4 do total = total + UInt64(t.ne[i] - 1) * UInt64(t.nb[i]) end
  else
    total = UInt64(t.ne[1]) * UInt64(t.nb[1]) / UInt64(info.blck)
    for i = 2, 4 do total = total + UInt64(t.ne[i] - 1) * UInt64(t.nb[i]) end
  end
  return total
end

local function shape_of(t)
  local ty = VS_TYPE[t.type] or ("TYPE_" .. tostring(t.type))
  return ty .. "[" .. table.concat(t.ne, ",") .. "]"
end

local function tensor_label(t)
  if t.id == UInt64(0) then return "(none)" end
  local name = (t.name ~= nil and t.name ~= "") and t.name or ("id=0x" .. t.id:tohex())
  local s = name .. " " .. shape_of(t)
  if t.op ~= nil and t.op ~= 0 then s = s .. " " .. (VS_OP[t.op] or ("OP_" .. t.op)) end
  return s
end

local function violation(ctx, item, text)
  ctx.violations = ctx.violations + 1
  item:add_proto_expert_info(E.violation, text)
end

-- A broken rule of the table (R, generated from ggml_rpc.spec.rules), named by its id.
local function broke(ctx, item, id, text)
  violation(ctx, item, "[" .. id .. "] " .. text)
end

local function check_type(ctx, item, t, where)
  if t.type >= TYPE_COUNT then
    broke(ctx, item, "TENSOR-TYPE", where .. ": type " .. t.type .. " is not a ggml type (< " .. TYPE_COUNT .. ")")
    return false
  end
  if TYPES[t.type].blck == 0 then
    broke(ctx, item, "TENSOR-REMOVED-TYPE", where .. ": type " .. t.type .. " (" .. VS_TYPE[t.type]
      .. ") was removed from ggml")
    return false
  end
  return true
end

local walk

local function read_scalar(e, r)
  local k = e.kind
  if k == "u64" then return r:le_uint64() end
  if k == "i64" then return r:le_int64() end
  if k == "u8" or k == "u16" or k == "u32" then return r:le_uint() end
  if k == "i8" or k == "i16" or k == "i32" then return r:le_int() end
  if k == "string" then return r:stringz() end
  return nil
end

local function add_item(tree, e, r, v)
  if e.kind == "bytes" then return tree:add(e.pf, r) end
  return tree:add_le(e.pf, r, v)
end

local function walk_struct(ctx, e, tvb, pos, tree, label)
  local lay = LAYOUTS[e.layout]
  local sub = tree:add(e.pf, tvb(pos, lay.size))
  local vals = {}
  walk(ctx, lay, tvb, pos, sub, vals)
  if lay.is_tensor then
    sub:set_text(label .. ": " .. tensor_label(vals))
    if vals.id ~= UInt64(0) then
      sub:add(HF.shape, tvb(pos, lay.size), shape_of(vals)):set_generated()
      local n = TYPES[vals.type] ~= nil and TYPES[vals.type].blck ~= 0 and nbytes(vals) or nil
      if n ~= nil then sub:add(HF.nbytes, tvb(pos, lay.size), n):set_generated() end
      -- names of the UNARY / GLU sub-ops carried in op_params[0]
      if vals.op == C.UNARY_OP then sub:add(HF.unary, tvb(pos, lay.size), vals.op_params[1]):set_generated() end
      if vals.op == C.GLU_OP then sub:add(HF.glu, tvb(pos, lay.size), vals.op_params[1]):set_generated() end
    end
  else
    sub:set_text(label)
  end
  return vals
end

-- Walk one layout at pos; fills vals (name -> value) and returns the position after it (or nil if cut short).
walk = function(ctx, lay, tvb, pos, tree, vals)
  local limit = ctx.limit
  for _, e in ipairs(lay.elems) do
    local count = e.count
    if e.count_from ~= nil then count = vals[e.count_from] end
    if count == nil then
      if pos + e.size > limit then
        if not ctx.partial then violation(ctx, tree, "payload ends inside field " .. e.name) end
        return nil
      end
      local r = tvb(pos, e.size)
      if e.kind == "struct" then
        vals[e.name] = walk_struct(ctx, e, tvb, pos, tree, e.name)
      else
        local v = read_scalar(e, r)
        local ti = add_item(tree, e, r, v)
        vals[e.name] = v
        if e.name == "flags" and lay.is_tensor then
          -- arithmetic rather than bit32/bit, which not every Lua that Wireshark embeds provides
          local u = v < 0 and v + 4294967296 or v
          for _, fl in ipairs(FLAG_FIELDS) do ti:add(fl[2], r, math.floor(u / fl[1]) % 2 == 1) end
        end
      end
      pos = pos + e.size
    else
      local total = count * e.size
      if pos + total > limit then
        if ctx.partial then return nil end
        violation(ctx, tree, e.name .. ": " .. count .. " items need " .. total .. " bytes, the payload has "
          .. math.max(0, limit - pos))
        return nil
      end
      local arr = {}
      if e.kind == "struct" then
        local at = tree:add(tvb(pos, math.max(total, 0)), e.name .. " [" .. count .. "]")
        for i = 1, count do
          arr[i] = walk_struct(ctx, e, tvb, pos, at, e.name .. "[" .. (i - 1) .. "]")
          pos = pos + e.size
        end
      else
        local shown = {}
        local at = tree:add(tvb(pos, math.max(total, 0)), e.name)
        for i = 1, count do
          local r = tvb(pos, e.size)
          local v = read_scalar(e, r)
          add_item(at, e, r, v)
          arr[i] = v
          if i <= 16 then shown[i] = e.hex and ("0x" .. v:tohex()) or tostring(v) end
          pos = pos + e.size
        end
        local more = count > 16 and ", ..." or ""
        at:set_text(e.name .. ": [" .. table.concat(shown, ", ") .. more .. "]")
      end
      vals[e.name] = arr
    end
  end
  return pos
end

-- The rule table's stateless rules (the codec's check_request).  Which fields each command's rules read comes from
-- R (generated from ggml_rpc.spec.rules): tensor fields, region lengths, copy pairs, rows.  The arithmetic (64-bit
-- bounds, row spans) and the graph rules (array membership) are logic and stay here.  As in the table, a message
-- breaks at most one rule: the first found.
local function check_rows(ctx, item, vals, it, with_data)
  local size, count, stride, off = vals.size, vals.n_copies, vals.stride, vals.offset
  if size == UInt64(0) or count == UInt64(0) then
    broke(ctx, item, "ROWS-ZERO", (size == UInt64(0) and "size" or "n_copies") .. " is 0")
    return
  end
  if with_data then
    -- size x n_copies == data length, tested without a product that could wrap
    local bulk = UInt64(it.bulk)
    if bulk % size ~= UInt64(0) or bulk / size ~= count then
      broke(ctx, item, "ROWS-DATA-LENGTH", tostring(bulk) .. " data bytes, but size " .. tostring(size)
        .. " x n_copies " .. tostring(count))
      return
    end
  end
  local k = count - UInt64(1)
  local rows = "rows at offset " .. tostring(off) .. ", " .. tostring(count) .. " x " .. tostring(size)
    .. " bytes, stride " .. tostring(stride) .. ": "
  if stride ~= UInt64(0) and k > (UInt64.max() - size) / stride then
    broke(ctx, item, "ROWS-SPAN-OVERFLOW", rows .. "overflows 64 bits")
    return
  end
  local span, nb = k * stride + size, nbytes(vals.tensor)
  if nb ~= nil and (off > nb or span > nb - off) then
    broke(ctx, item, "ROWS-PAST-TENSOR", rows .. "runs past the tensor's " .. tostring(nb) .. " bytes")
  end
end

local function check_graph(ctx, item, vals)
  local ids = {}
  for i, tt in ipairs(vals.tensors or {}) do
    ids[tostring(tt.id)] = true
    if tt.type >= TYPE_COUNT then
      return broke(ctx, item, "TENSOR-TYPE", "tensor " .. (i - 1) .. " has type " .. tt.type)
    end
  end
  if vals.n_nodes == 0 then return broke(ctx, item, "GRAPH-NO-NODES", "a graph without nodes") end
  for _, node in ipairs(vals.nodes) do
    if node == UInt64(0) then return broke(ctx, item, "GRAPH-NULL-NODE", "node id 0 (a null node)") end
  end
  for i, node in ipairs(vals.nodes) do
    if not ids[tostring(node)] then
      return broke(ctx, item, "GRAPH-NODE-UNKNOWN", "node id 0x" .. node:tohex() .. " is not among the tensors (nodes["
        .. (i - 1) .. "])")
    end
  end
end

local function check_request(ctx, item, vals, it)
  if it.shape == "GRAPH" and vals.nodes ~= nil then return check_graph(ctx, item, vals) end
  local name = cmd_name(it.cmd, it.version)
  for _, f in ipairs(R.TENSOR_FIELDS[name] or {}) do
    local t = vals[f]
    if t ~= nil and t.type ~= nil and not check_type(ctx, item, t, f) then return end
  end
  local length = R.REGION_LENGTH[name]
  if length ~= nil and vals.tensor ~= nil and vals.offset ~= nil then
    local n = length == "" and UInt64(it.bulk) or vals[length]
    local nb = nbytes(vals.tensor)
    if n ~= nil and nb ~= nil and n ~= UInt64(0) and (vals.offset > nb or n > nb - vals.offset) then
      return broke(ctx, item, "REGION-PAST-TENSOR", "region offset " .. tostring(vals.offset) .. " + " .. tostring(n)
        .. " bytes runs past the tensor's " .. tostring(nb) .. " bytes")
    end
  end
  local pair = R.COPIES[name]
  if pair ~= nil and vals[pair[1]] ~= nil and vals[pair[2]] ~= nil then
    local s, d = nbytes(vals[pair[1]]), nbytes(vals[pair[2]])
    if s ~= nil and d ~= nil and s > d then
      return broke(ctx, item, "COPY-FITS-DST", "copies " .. tostring(s) .. " bytes into a " .. tostring(d)
        .. "-byte tensor")
    end
  end
  if R.ROWS[name] ~= nil and vals.tensor ~= nil and vals.size ~= nil then
    check_rows(ctx, item, vals, it, R.ROWS[name])
  end
end

-- One line per message with a fixed shape, so that field extraction (tshark -T fields) stays aligned even when a
-- message lacks some fields: "<dir> <command> <index> <payload length> <violations>" ("?" when unknown).
local function add_pdu_line(item, tvb, it, dir, name, ctx)
  local size = it.size
  if size == nil then
    local hdr = it.kind == "req" and C.CMD_LEN or 0
    size = tostring(tvb(it.off + hdr, C.SIZE_LEN):le_uint64())
  end
  local line = dir .. " " .. name .. " " .. (it.index ~= nil and tostring(it.index) or "?") .. " " .. tostring(size)
    .. " " .. ctx.violations
  item:add(HF.pdu, tvb(it.off, 0), line):set_generated()
end

local function render_message(c, it, tvb, pinfo, tree, info)
  local is_req = it.kind == "req"
  local hdr = is_req and C.REQ_HDR or C.REP_HDR
  local body_len = math.max(0, math.min(it.len, tvb:len() - it.off) - hdr)
  local item = tree:add(P, tvb(it.off, it.len))
  local ctx = { violations = 0, limit = it.off + hdr + body_len }
  local dir = is_req and "request" or "reply"
  local name = it.cmd ~= nil and cmd_name(it.cmd, it.version) or "?"
  item:set_text("ggml RPC " .. name .. " " .. dir)
  item:add(HF.dir, tvb(it.off, 0), dir)
  if is_req then
    item:add(HF.cmd, tvb(it.off, C.CMD_LEN)):append_text(" (" .. name .. ")")
    item:add_le(HF.len, tvb(it.off + C.CMD_LEN, C.SIZE_LEN))
  else
    if it.cmd ~= nil then
      item:add(HF.cmd, tvb(it.off, 0), it.cmd):append_text(" (" .. name .. ")"):set_generated()
    end
    item:add_le(HF.len, tvb(it.off, C.SIZE_LEN))
  end
  if it.index ~= nil then item:add(HF.index, tvb(it.off, 0), it.index):set_generated() end
  if it.version ~= nil and (not is_req or it.version_known) then
    item:add(HF.version, tvb(it.off, 0), it.version):set_generated()
  end
  if is_req and it.index ~= nil then
    local rf = c.rep_frames[it.index]
    if rf ~= nil then item:add(REP_FRAME, tvb(it.off, 0), rf):set_generated() end
  elseif it.req_frame ~= nil then
    item:add(REQ_FRAME, tvb(it.off, 0), it.req_frame):set_generated()
  end
  local summary = name .. (is_req and "" or " reply")
  if it.error ~= nil then
    violation(ctx, item, it.error)
    info[#info + 1] = summary .. " [violation]"
    item:add(HF.violations, tvb(it.off, 0), ctx.violations):set_generated()
    add_pdu_line(item, tvb, it, dir, name, ctx)
    return
  end
  local proto = protocol_by_label(it.version)
  local spec = proto.commands[it.cmd]
  local payload = is_req and spec.request or spec.reply
  it.shape = payload.shape
  local vals = {}
  local pos = it.off + hdr
  if payload.shape ~= "RAW" then
    if it.graph_partial then
      ctx.limit = pos + payload.size
      ctx.partial = true
      item:add_proto_expert_info(E.note, "graph of " .. it.size .. " bytes: too large to decode, header shown")
    end
    local lay = payload.layout
    local after = walk(ctx, lay, tvb, pos, item, vals)
    if after ~= nil and payload.shape == "GRAPH" and not it.graph_partial and after < it.off + hdr + it.size then
      item:add(HF.trailing, tvb(after, it.off + hdr + it.size - after), it.off + hdr + it.size - after)
    end
  end
  if it.bulk ~= nil and it.bulk > 0 or payload.shape == "HEADER_DATA" or payload.shape == "RAW" then
    local bpos = it.off + it.len - it.bulk_here
    item:add(HF.data_len, tvb(bpos, it.bulk_here), UInt64(it.bulk))
    item:add(HF.data_here, tvb(bpos, it.bulk_here), it.bulk_here)
  end
  if is_req then check_request(ctx, item, vals, it) end
  if it.no_reply then item:add_proto_expert_info(E.chat, name .. " has no reply") end
  if vals.cache_flag ~= nil and vals.cache_flag ~= 0 then
    item:add_proto_expert_info(E.note, "cache_flag set: a server with a cache saves this payload")
  end
  if it.announced ~= nil then
    if it.picked ~= nil then
      item:add_proto_expert_info(E.chat, "server speaks " .. it.announced .. ": using the " .. it.picked .. " table")
    else
      violation(ctx, item, it.version_error)
    end
  end
  item:add(HF.violations, tvb(it.off, 0), ctx.violations):set_generated()
  add_pdu_line(item, tvb, it, dir, name, ctx)
  -- Info column
  local t = vals.tensor
  if t ~= nil and t.type ~= nil then summary = summary .. " " .. tensor_label(t) end
  if vals.src ~= nil and vals.dst ~= nil and vals.src.type ~= nil then
    summary = summary .. " " .. tensor_label(vals.src) .. " -> " .. tensor_label(vals.dst)
  end
  if it.bulk ~= nil and it.bulk > 0 then summary = summary .. " " .. it.bulk .. " bytes" end
  if vals.n_nodes ~= nil then summary = summary .. " nodes=" .. vals.n_nodes end
  if it.announced ~= nil then summary = summary .. " " .. it.announced end
  if ctx.violations > 0 then summary = summary .. " [violation]" end
  item:append_text(" (" .. (it.index ~= nil and ("#" .. it.index) or "") .. ")")
  info[#info + 1] = summary
end

local last_info = { frame = -1, text = "" }

local function render(res, tvb, pinfo, tree)
  local info = {}
  local c = res.conv
  for _, it in ipairs(res.items) do
    if it.kind == "cont" then
      local item = tree:add(P, tvb(it.off, it.len))
      item:set_text("ggml RPC, continuation of " .. cmd_name(it.cmd, it.version) .. " data (" .. it.len .. " bytes)")
      item:add(HF.cont, tvb(it.off, it.len), it.len)
      item:add(CONT_FRAME, tvb(it.off, 0), it.frame)
      item:add(HF.cont_left, tvb(it.off, 0), UInt64(it.left))
      info[#info + 1] = "[" .. cmd_name(it.cmd, it.version) .. " data]"
    elseif it.kind == "dead" then
      local item = tree:add(P, tvb(it.off, it.len))
      item:set_text("ggml RPC, " .. it.len .. " bytes after a violation")
      item:add(HF.ignored, tvb(it.off, it.len), it.len)
      item:add_proto_expert_info(E.note, "not decoded: " .. it.why)
      info[#info + 1] = "[after violation]"
    else
      render_message(c, it, tvb, pinfo, tree, info)
    end
  end
  if #info == 0 then return end
  local text = table.concat(info, " | ")
  -- TCP fences the column between the messages of one frame: a second call in the same frame appends.
  if last_info.frame == pinfo.number and tostring(pinfo.cols.info):find(last_info.text, 1, true) then
    pinfo.cols.info:append(" | " .. text)
  else
    pinfo.cols.info:set(text)
  end
  last_info.frame, last_info.text = pinfo.number, text
end

function P.dissector(tvb, pinfo, tree)
  local len = tvb:len()
  if len == 0 then return 0 end
  pinfo.cols.protocol = "GGML-RPC"
  local key = pinfo.number .. ":" .. len .. ":" .. (len >= 4 and tvb(0, 4):uint() or tvb(0, 1):uint())
  local res = results[key]
  if res == nil then
    if pinfo.visited then
      -- A call the first pass did not see: nothing safe to say about it.
      tree:add(P, tvb()):set_text("ggml RPC, segment not seen on the first pass")
      return len
    end
    res = analyse(tvb, pinfo)
    results[key] = res
  end
  render(res, tvb, pinfo, tree)
  if res.deseg_len ~= nil then
    pinfo.desegment_offset = res.deseg_off
    pinfo.desegment_len = res.deseg_len
  end
  return len
end

local function heuristic(tvb, pinfo, tree)
  local key = conv_key(pinfo)
  local first = not seen_pairs[key]
  seen_pairs[key] = true
  if not hello_prefix(tvb) then return false end
  -- Only the first bytes of a connection: tcp.seq when the tree has it, else the first segment seen on it.
  local seq = f_seq()
  if seq ~= nil then
    if seq.value ~= 1 then return false end
  elseif not first then
    return false
  end
  local c = convs[key]
  if c ~= nil and c.req.hello then return false end
  pinfo.conversation = P
  P.dissector(tvb, pinfo, tree)
  return true
end

DissectorTable.get("tcp.port"):add(C.PORT, P)
P:register_heuristic("tcp", heuristic)
