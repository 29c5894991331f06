"""How the machines talk: every cross-machine wire, as data.

A machine's table emits internal actions; the ControlPlane turns each into
events of another machine exactly as a ``Wire`` here says: which event, to
which machine, and where each of its fields comes from.  Nothing else moves
between machines (besides a ``Spec.source``, declared on the using machine,
and the creating events each spec declares in ``created_by``).
``validate_composition`` proves the wiring against the machines' alphabets
and ``render_composition`` draws it.

Timers are the framework's (ArmTimer / CancelTimer, run by the plane).
"""
from __future__ import annotations

import attrs

from . import actions as A
from . import events as E
from .base import Action, Event


# ------------------------------------------------------- where a field comes from
@attrs.frozen
class ActionField:
    """A field of the action."""

    name: str


@attrs.frozen
class ConfigField:
    """A PlaneConfig field."""

    name: str


@attrs.frozen
class Const:
    value: object


@attrs.frozen
class TargetField:
    """A field of the target instance (the wire needs it live)."""

    name: str


@attrs.frozen
class RequesterKind:
    """The machine kind of the requester the event goes to (see ``REQUESTERS``)."""


@attrs.frozen
class RequesterKey:
    """The id of the requester the event goes to (see ``REQUESTERS``)."""


@attrs.frozen
class HeartbeatChain:
    """Our heartbeats to the action's engine (``Heartbeats.chain``):
    ``"last"`` batch sent, or the first (``"since"``) of its unbroken chain."""

    which: str = attrs.field(validator=attrs.validators.in_(("since", "last")))


@attrs.frozen
class EngineField:
    """A field of the action's engine (its remote_engine instance; None
    when it has none): read at the wire, so the action (and the event logs
    that record it) stays as it was."""

    name: str


FieldSource = (ActionField | ConfigField | Const | TargetField | RequesterKind | RequesterKey | HeartbeatChain
               | EngineField)


# ------------------------------------------------------------------ targets
@attrs.frozen
class Requesters:
    """Fan out: one event to each (kind, key) in the action's ``requesters``,
    addressed to that requester's machine.  The requesters are the machines
    whose tables emit ``acquired_by`` (a reference to the engine)."""

    field: str
    acquired_by: type[Action]


@attrs.frozen
class Wire:
    """An internal ``action`` of one machine becomes ``event`` of ``target``."""

    action: type[Action]
    target: str | Requesters
    event: type[Event]
    fields: tuple[tuple[str, FieldSource], ...]
    # Dropped unless the target instance is live (a release or activity for an
    # engine already evicted; a push completing after its lease ended).
    only_if_live: bool = False
    doc: str = ""


_REFERENCE = (("engine_id", ActionField("engine_id")), ("requester_kind", ActionField("kind")),
              ("requester_key", ActionField("key")))
REQUESTERS = Requesters("requesters", acquired_by=A.AcquireEngine)

WIRES: tuple[Wire, ...] = (
    # Heartbeats start at arrival: a decode request registers its peer id with
    # the engine's batch (created by the first registration), until it ends.
    Wire(A.StartHeartbeat, "heartbeat", E.HeartbeatRegister, (
        ("engine_id", ActionField("engine_id")), ("request_id", ActionField("remote_request_id")),
        ("ranks", ActionField("ranks")),
    )),
    Wire(A.StopHeartbeat, "heartbeat", E.HeartbeatUnregister, (
        ("engine_id", ActionField("engine_id")), ("request_id", ActionField("remote_request_id")),
    ), only_if_live=True, doc="a batch that already ended has nothing to unregister"),
    # Engine references: a request needs the engine connected, and it is never
    # evicted while referenced.
    Wire(A.AcquireEngine, "remote_engine", E.EngineAcquire, _REFERENCE),
    Wire(A.ReleaseEngine, "remote_engine", E.EngineRelease, _REFERENCE, only_if_live=True),
    Wire(A.NoteActivity, "remote_engine", E.EngineActivity, (("engine_id", ActionField("engine_id")),),
         only_if_live=True, doc="any READ, WRITE or completion refreshes the engine's liveness"),
    Wire(A.SupersedeEngine, "remote_engine", E.PeerDisconnected, (
        ("engine_id", ActionField("engine_id")), ("reason", Const("superseded by a newer incarnation")),
    ), only_if_live=True, doc="a request's params name a newer incarnation: the connected one is gone"),
    Wire(A.WakeRequesters, REQUESTERS, E.EngineReady, (
        ("kind", RequesterKind()), ("request_id", RequesterKey()), ("engine_id", ActionField("engine_id")),
        ("clock_offset", ActionField("clock_offset")),
        # The READ gate's heartbeat evidence travels with the wake-up.
        ("heartbeat_at", HeartbeatChain("last")), ("heartbeats_since", HeartbeatChain("since")),
        ("incarnation", EngineField("incarnation")),
    )),
    Wire(A.FailRequesters, REQUESTERS, E.EngineLost, (
        ("kind", RequesterKind()), ("request_id", RequesterKey()), ("engine_id", ActionField("engine_id")),
        ("reason", ActionField("reason")),
    )),
    # A decoder's turn-2 hold: one consumer, a fixed TTL, not renewed by heartbeats.
    Wire(A.GrantHold, "lease", E.LeaseGranted, (
        ("request_id", ActionField("request_id")), ("block_ids", ActionField("block_ids")),
        ("expected_consumers", Const(1)), ("duration", ConfigField("decoder_kv_blocks_ttl")),
        ("renewable", Const(False)),
    )),
    # A completed push WRITE consumes P's lease like a READ, with the lease's own plan.
    Wire(A.ConsumeLease, "lease", E.ConsumerDone, (
        ("request_id", ActionField("request_id")), ("consumer", ActionField("consumer")),
        ("expected_consumers", TargetField("expected_consumers")),
    ), only_if_live=True),
)

