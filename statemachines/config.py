"""Plane configuration.  Durations in seconds; derived values are properties
so that the single source of truth is ``kv_lease_duration``.

Every number must be finite and in range: a NaN or infinite duration would
make a comparison that guards blocks (a deadline, the READ gate) silently
false.  A bad value raises ``ConfigError`` naming the field.
"""
from __future__ import annotations

import functools

import math
from collections.abc import Mapping
from typing import Any

import attrs

LOAD_FAILURE_POLICIES = ("fail", "recompute")
# Exponential backoff doubles per attempt; beyond this the delay is absurd
# (2**63 s) and the float arithmetic overflows.
MAX_HANDSHAKE_ATTEMPTS = 64


class ConfigError(ValueError):
    """A PlaneConfig field with a bad value; ``field`` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def _number(minimum: float, *, strict: bool = False, integer: bool = False, maximum: float | None = None):
    """A validator: a finite real number (an int when ``integer``) that is
    >= ``minimum`` (> when ``strict``) and <= ``maximum``."""
    kind = "an integer" if integer else "a finite number"
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    if maximum is not None:
        bound += f" and <= {maximum:g}"

    def check(inst, attribute, value):
        ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type:
            raise ConfigError(attribute.name, f"must be {kind} {bound}, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(attribute.name, f"must be {kind} {bound}, got {value!r}")
        if (value <= minimum if strict else value < minimum) or (maximum is not None and value > maximum):
            raise ConfigError(attribute.name, f"must be {bound}, got {value!r}")

    return check


def _positive(inst, attribute, value):
    _number(0, strict=True)(inst, attribute, value)


def _flag(inst, attribute, value):
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be true or false, got {type(value).__name__} {value!r}")


def _policy(inst, attribute, value):
    if value not in LOAD_FAILURE_POLICIES:
        raise ConfigError(attribute.name, f"must be one of {', '.join(LOAD_FAILURE_POLICIES)}, got {value!r}")


@attrs.frozen(kw_only=True)
class PlaneConfig:
    # Prefill lease: granted for this long, extended by heartbeats.  At least
    # 6 s, so the heartbeat interval (d // 6) is at least one second.
    kv_lease_duration: float = attrs.field(default=30.0, validator=_number(6))
    # Bidirectional: how long D keeps a finished request's blocks for turn 2.
    decoder_kv_blocks_ttl: float = attrs.field(default=480.0, validator=_positive)
    # Turn-2 reads are declined this close to the remote expiry.
    expiry_safety_margin: float = attrs.field(default=5.0, validator=_number(0))
    # A connected engine with no activity for this long is evicted (STALE at
    # half of it) unless a transfer still references it.
    engine_ttl: float = attrs.field(default=60.0, validator=_positive)
    # Silence until STALE; evicted at twice this.  None: engine_ttl / 2, so an
    # idle engine is gone one TTL after its last activity.  Event logs whose
    # config lacks the key are from before, when STALE came at engine_ttl
    # (eviction at two TTLs): the log reader sets it so they replay as recorded.
    engine_stale_after: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive))
    handshake_timeout: float = attrs.field(default=5.0, validator=_positive)
    handshake_backoff: float = attrs.field(default=1.0, validator=_positive)
    handshake_max_attempts: int = attrs.field(
        default=3, validator=_number(1, integer=True, maximum=MAX_HANDSHAKE_ATTEMPTS))
    # Bound on one posted READ/WRITE: a hung peer keeps a transfer in PROC forever.
    transfer_timeout: float = attrs.field(default=30.0, validator=_positive)
    # Bound on a whole recv, from block allocation to the last byte.
    recv_timeout: float = attrs.field(default=120.0, validator=_positive)
    # Push mode: how long P keeps a D registration, and D waits for P's WRITE.
    push_registration_timeout: float = attrs.field(default=60.0, validator=_positive)
    kv_load_failure_policy: str = attrs.field(default="recompute", validator=_policy)
    # Send each remote engine's heartbeat batches on a grid with the engine's
    # own phase (heartbeat_phase.py), so engines that started in the same
    # step do not all send in one step for ever.  False: each batch one
    # interval after the last (lockstep).  Event logs whose config lacks the
    # key are from before, when batches went out in lockstep: the log reader
    # sets it False so they replay as recorded.
    heartbeat_spread: bool = attrs.field(default=True, validator=_flag)

    @functools.cached_property  # read on the hot path: computed once (a slot after that)
    def stale_after(self) -> float:
        """Seconds of silence until a connected engine is STALE (eviction: twice that)."""
        return self.engine_ttl / 2 if self.engine_stale_after is None else self.engine_stale_after

    @functools.cached_property  # read on the hot path: computed once (a slot after that)
    def heartbeat_interval(self) -> float:
        return self.kv_lease_duration // 6

    @functools.cached_property  # read on the hot path: computed once (a slot after that)
    def lease_extension(self) -> float:
        return self.kv_lease_duration * 2 // 3

    @classmethod
    def from_kv_transfer_config(cls, kv_transfer_config: Mapping[str, Any]) -> FromKvTransferConfig:
        """A PlaneConfig from a vLLM-style ``kv_transfer_config`` dict.

        The plane's settings are the keys of ``kv_connector_extra_config``
        named as PlaneConfig's fields (``kv_lease_duration``, vLLM's lease
        key, ``decoder_kv_blocks_ttl``, ...); ``kv_load_failure_policy`` may
        also be a top-level key, as in vLLM.  Other top-level keys are vLLM's
        (``kv_connector``, ``kv_role``, ...) and are not looked at.  Keys of
        the extra config that are no field are returned in ``unknown_keys``
        for the caller to warn about (this module does no I/O).  A value of
        the wrong type, out of range or not finite raises ``ConfigError``.
        """
        if not isinstance(kv_transfer_config, Mapping):
            raise ConfigError("kv_transfer_config", f"must be a dict, got {type(kv_transfer_config).__name__}")
        extra = kv_transfer_config.get("kv_connector_extra_config") or {}
        if not isinstance(extra, Mapping):
            raise ConfigError("kv_connector_extra_config", f"must be a dict, got {type(extra).__name__}")
        fields = {f.name for f in attrs.fields(cls)}
        values = {}
        policy = "kv_load_failure_policy"
        if kv_transfer_config.get(policy) is not None:
            values[policy] = kv_transfer_config[policy]
        unknown = []
        for key, value in extra.items():
            if key not in fields:
                unknown.append(str(key))
            elif key == policy and policy in values and values[policy] != value:
                raise ConfigError(policy, f"given twice with different values: {values[policy]!r} at the top "
                                          f"level, {value!r} in kv_connector_extra_config")
            else:
                values[key] = value
        return FromKvTransferConfig(config=cls(**values), unknown_keys=tuple(sorted(unknown)))


@attrs.frozen
class FromKvTransferConfig:
    """What ``PlaneConfig.from_kv_transfer_config`` found."""

    config: PlaneConfig
    # Keys of kv_connector_extra_config that are no PlaneConfig field (a typo,
    # or another component's setting): the caller warns about them.
    unknown_keys: tuple[str, ...] = ()
