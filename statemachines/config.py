"""Plane configuration.  Durations in seconds; derived values are properties
so that the single source of truth is ``kv_lease_duration``."""
from __future__ import annotations

import attrs

LOAD_FAILURE_POLICIES = ("fail", "recompute")


def _positive(inst, attribute, value):
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class PlaneConfig:
    # Prefill lease: granted for this long, extended by heartbeats.  At least
    # 6 s, so the heartbeat interval (d // 6) is at least one second.
    kv_lease_duration: float = attrs.field(default=30.0, validator=attrs.validators.ge(6))
    # Bidirectional: how long D keeps a finished request's blocks for turn 2.
    decoder_kv_blocks_ttl: float = attrs.field(default=480.0, validator=_positive)
    # Turn-2 reads are declined this close to the remote expiry.
    expiry_safety_margin: float = attrs.field(default=5.0, validator=attrs.validators.ge(0))
    # A connected engine with no activity for this long becomes STALE, and is
    # evicted one more TTL later unless a transfer still references it.
    engine_ttl: float = attrs.field(default=60.0, validator=_positive)
    handshake_timeout: float = attrs.field(default=5.0, validator=_positive)
    handshake_backoff: float = attrs.field(default=1.0, validator=_positive)
    handshake_max_attempts: int = attrs.field(default=3, validator=_positive)
    # Bound on one posted READ/WRITE: a hung peer keeps a transfer in PROC forever.
    transfer_timeout: float = attrs.field(default=30.0, validator=_positive)
    # Bound on a whole recv, from block allocation to the last byte.
    recv_timeout: float = attrs.field(default=120.0, validator=_positive)
    # Push mode: how long P keeps a D registration, and D waits for P's WRITE.
    push_registration_timeout: float = attrs.field(default=60.0, validator=_positive)
    kv_load_failure_policy: str = attrs.field(default="recompute", validator=attrs.validators.in_(LOAD_FAILURE_POLICIES))

    @property
    def heartbeat_interval(self) -> float:
        return self.kv_lease_duration // 6

    @property
    def lease_extension(self) -> float:
        return self.kv_lease_duration * 2 // 3
