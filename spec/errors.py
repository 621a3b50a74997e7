"""Typed protocol errors: each names the command, the field and the byte offset where the stream broke the spec."""

from __future__ import annotations


class ProtocolError(Exception):
    """Bytes that break the ggml RPC protocol.

    ``offset`` is the byte offset in the stream being decoded (or in the payload, for a payload on its own).
    """

    def __init__(
        self,
        message: str,
        *,
        command: str | None = None,
        field: str | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.command = command
        self.field = field
        self.offset = offset

    def __str__(self) -> str:
        where = []
        if self.command:
            where.append(self.command)
        if self.field:
            where.append(f"field {self.field!r}")
        if self.offset is not None:
            where.append(f"at byte {self.offset}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


class UnknownCommand(ProtocolError):
    """A command id the negotiated version does not define (or NONE, which is never sent)."""


class SizeMismatch(ProtocolError):
    """A size header that does not fit the command's layout."""


class SizeLimitExceeded(ProtocolError):
    """A size claim above the configured limit: refused before anything is allocated."""


class Truncated(ProtocolError):
    """The stream ended inside a message."""


class UnexpectedReply(ProtocolError):
    """Reply bytes while no request awaits a reply."""


class HandshakeError(ProtocolError):
    """HELLO missing, repeated or malformed."""


class SpecViolation(ProtocolError):
    """A well-framed message whose content breaks a rule (an invalid type, a region past the tensor...)."""


class EncodeError(ProtocolError):
    """Values that do not fit the fields of the message being built (a caller's mistake, not a peer's)."""
