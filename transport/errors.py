"""Typed transport errors.

NIXL raises one exception class per status code with no common base class, so
callers would otherwise have to catch a dozen unrelated types.  Everything the
transport layer raises at runtime derives from :class:`TransportError`; the
original NIXL exception is kept as ``__cause__`` and its text in the message.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class for runtime failures of the transport layer."""

    def __init__(self, message: str, *, nixl_error: str | None = None) -> None:
        super().__init__(message)
        # Name of the NIXL exception class this was mapped from, if any.
        self.nixl_error = nixl_error


class TransferFailed(TransportError):
    """A transfer (or a notification bound to it) failed and will not complete."""


class PeerDisconnected(TransportError):
    """The remote agent went away (process died, connection reset)."""


class NotFound(TransportError):
    """The named remote agent / descriptor / handle is unknown to the agent."""


class MetadataRejected(TransportError):
    """The agent refused remote metadata (NIXL could not deserialize it)."""


class IncompatibleLayout(TransportError, ValueError):
    """Local and remote KV-cache layouts cannot be paired block for block."""


class InvalidPart(ValueError):
    """A block part that is no ``(index, of)`` pair of ints with ``of >= 1`` and
    ``0 <= index < of`` (a caller's mistake, like an out-of-range block id)."""
