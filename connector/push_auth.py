"""D signs its ``PUSH_REG``; P WRITEs only for a registration it verifies.

A registration tells P where to WRITE a lease's KV (D's side channel, D's
block ids).  NIXL does not authenticate who sends a notification, and the
lease's name is in the params every client of P sees, so in a deployment
(one secret, ``secret``) D adds ``mac``: HMAC-SHA256 with the deployment's
MAC key over a label and every other field of the registration; P accepts
a registration whose MAC verifies under one of the deployment's keys (the
first signs; the others are accepted during a key change).  Without it, a
holder of a lease name could make P overwrite any blocks of a deployment's
decoder with that lease's KV.  The WRITE's target must also prove the
deployment's CURVE key at the handshake (the driver).
"""
from __future__ import annotations

import hmac
import hashlib

import attrs

from kvplane.transport.wire import PushRegistration

LABEL = b"kvplane-push-reg-v1\x00"


def _mac(reg: PushRegistration, key: bytes) -> str:
    return hmac.new(key, LABEL + reg.signed_bytes(), hashlib.sha256).hexdigest()


def sign_push_reg(reg: PushRegistration, key: bytes) -> PushRegistration:
    return attrs.evolve(reg, mac=_mac(reg, key))


def push_reg_vouched(reg: PushRegistration, keys: tuple[bytes, ...]) -> bool:
    """Whether ``reg`` carries a MAC made with one of ``keys``."""
    if reg.mac is None:
        return False
    return any(hmac.compare_digest(reg.mac, _mac(reg, key)) for key in keys)
