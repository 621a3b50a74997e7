"""The ggml RPC protocol, declared once: enums, the rpc_tensor Struct, per-version command tables, a sans-IO codec.

Everything else in the kit (reference server, conformance checks, docs, dissector, fuzz strategies) derives from
what this package declares; its renderers (PROTOCOL.md, the Lua dissector) are :mod:`.render`.
"""

from .codec import (
    DEFAULT_MAX_PAYLOAD,
    REPLY_HEADER_SIZE,
    REQUEST_HEADER_SIZE,
    TENSOR_DTYPE,
    TENSOR_LAYOUT,
    Reply,
    ReplyDecoder,
    Request,
    RequestDecoder,
    check_request,
    decode_payload,
    encode_payload,
    encode_reply,
    encode_request,
    protocol_from_hello,
    reply_parts,
    request_parts,
    tensors_array,
)
from .enums import (
    GGML_OP_COUNT,
    GGML_TYPE_COUNT,
    NATIVE_CALLBACK_OPS,
    NEVER_ON_WIRE,
    TYPES,
    Command,
    Direction,
    GgmlOp,
    GgmlType,
    GluOp,
    TensorFlag,
    TypeInfo,
    UnaryOp,
    command_name,
    op_name,
    type_name,
)
from .errors import (
    EncodeError,
    HandshakeError,
    ProtocolError,
    SizeLimitExceeded,
    SizeMismatch,
    SpecViolation,
    Truncated,
    UnexpectedReply,
    UnknownCommand,
)
from .facts import (
    CONN_CAPS_SIZE,
    DEFAULT_HOST,
    DEFAULT_PORT,
    HASH_THRESHOLD,
    cache_file_name,
    contiguous_strides,
    fnv1a64,
    ggml_nbytes,
    hello_reply,
    tensor_nbytes,
)
from .messages import NO_REPLY, Payload, Shape
from .tensor import RPC_TENSOR_SIZE, RpcTensor, encode_name, make_tensor, null_tensor, tensor_name
from .versions import (
    BY_LABEL,
    PROTOCOLS,
    V6,
    V7,
    V7_0_1,
    V8,
    CacheRule,
    CommandSpec,
    Protocol,
    parse_version_option,
    protocol_for,
)

__all__ = [name for name in dir() if not name.startswith("_")]
