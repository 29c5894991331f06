"""Explicit-state model checker for a composed P/D system.

The model: a decode ControlPlane "D" and a prefill ControlPlane "P" (the
real machines, or mutated ones), an abstract network between them, and a
scheduler per side.  Each request i is, on D, decode_request ``d<i>``
reading P's lease ``p<i>``; with the "read2" profile D holds its blocks
after finishing (lease ``d<i>`` on D) and P reads them back for turn 2 as
decode_request ``q<i>``; with the "push" profile D registers its blocks
(PUSH_REG) and P's push_write ``p<i>`` WRITEs from its lease ``p<i>``.
P's clock is D's plus ``skew``.

Moves (each a BFS edge):
- scheduler: arrive (P grants the lease and D gets the request with P's
  lease expiry, renewable, as the connector exports it), allocate, start
  load, run (only after the recv was reported), finish, abort (budgeted),
  the turn-2 counterparts, and for a push P aborting its lease (budgeted
  with the aborts: P's client went away);
- network: deliver any in-flight message (so reordering is implicit):
  handshake replies, READ and WRITE executions and completions, completion
  notifs, push registrations, heartbeats, disconnect notices;
- faults (``max_faults`` in total): lose or duplicate a notif/heartbeat,
  fail or hang a handshake, fail or hang a READ or WRITE (a hung peer),
  crash P; a hung transfer may complete late (before it is cancelled); and, outside
  the default set (``STALL_FAULTS``), D stalls: for up to ``stall``
  seconds D does nothing (no timers, so no heartbeats and no deadlines;
  no scheduling; what is addressed to D waits, a request P exported
  included) while P's clock and timers run on; the fabric may execute
  D's posted READ meanwhile.  D resumes at any point P's timers or the
  bound reach, firing its due timers before it handles anything, as the
  driver does;
  and, also outside the default set (``RESTART_FAULTS``), D restarts: a
  fresh D plane with the same engine id (its requests, holds and loop's
  messages gone, what it sent still in flight, P told it disconnected);
  the new incarnation must never complete a lease P granted the old one;
- tick: advance time to the next deadline of either plane and fire timers.
  Time only advances when no message is in flight (delivery is faster than
  any timer), except for hung READs.

Abstractions, chosen so that the real machines pass: block ids are the
same for every request (they are opaque to the machines), so requests of
one profile are interchangeable; a cancelled READ does not execute; a
crashed P stays down (its memory went with it, so its leases are no longer
checked).  Push mode is modeled as far as P's side needs: D's blocks are
not checked (D cannot see or stop a one-sided WRITE; see docs/known-gaps.md).

State hashing: a canonical tuple of each plane's instances (kind, state,
relevant fields, times relative to the plane's now) + live timers (the
instances' deadlines and the heartbeat schedule, with each chain's last
send) + network + scheduler and bookkeeping + the stall; what the READ
gate reads (remote expiry, arrival, the chain's first and last send)
enters as the exact comparisons the gate makes
(``canonical.gate_signature``); with symmetry reduction the requests are
renamed so that their request-local signatures are sorted.

Checks after every move (safety): no READ posted or executed against a
lease that is not held, or whose expiry (in the reader's clock) is <= now
(P's: reading freed blocks; D's: a turn-2 read of expired D-held blocks);
a READ the fabric executed against such a lease while D was stalled is
no violation by itself, but D accepting its completion is (the READ
deadline must refuse it); no WRITE posted or executed from a lease that is
not held (the push outliving its lease); FreeBlocks at most once per lease; ReportRecv only
for an awaited recv, at most once; no request holds an engine_ref to an
engine that is gone (evicted under it); no engine STALE within stale_after
of observed activity; no protocol violation.  Liveness: from every
explored state a deterministic, fault-free drain (deliver, schedule, tick)
must reach quiescence with nothing held, no request alive and every
awaited recv reported; drains are memoized on canonical states.

On a violation the shortest move sequence (BFS) is returned, with both
planes' event logs (replayable JSONL, see ``replay``); writing them is the
caller's (``kvplane explore --out``).

Modules: ``config`` (profiles, faults, ExploreConfig), ``world`` (World,
phases, clocks), ``messages`` (what is in flight), ``moves`` (moves and the
schedulers' phase table), ``model`` (which moves a world offers, what each
does, how the planes' actions are executed), ``checks`` (safety and
quiescence), ``canonical`` (state hashing, symmetry), ``search`` (BFS,
drains, counterexamples), ``ranks`` (one plane per worker rank),
``engine_model`` (vLLM's scheduler driving the engine_request machine over
the ranks; ``model_for`` picks the model a configuration asks for).
"""
from __future__ import annotations

from .canonical import GATE_STATES
from .checks import HELD_LEASE, Found
from .config import (ENGINE_FAULTS, EXPLORER_PLANE_CONFIG, FAULTS, PROFILES, RANK_FAULTS, RESTART_FAULTS, STALL_FAULTS, ExploreConfig,
                     Profile)
from .model import IGNORED_ACTIONS, Model
from .engine_model import EngineModel, model_for
from .ranks import RankModel, RankWorld
from .search import ExploreResult, SearchProgress, Violation, explore
from .world import World, clone_plane

_Found = Found  # the name the tests have used

__all__ = [
    "ENGINE_FAULTS", "EXPLORER_PLANE_CONFIG", "FAULTS", "GATE_STATES", "HELD_LEASE", "IGNORED_ACTIONS", "PROFILES", "RANK_FAULTS",
    "RESTART_FAULTS", "STALL_FAULTS",
    "EngineModel", "ExploreConfig", "ExploreResult", "Found", "Model", "Profile", "RankModel", "RankWorld", "SearchProgress",
    "Violation", "World", "clone_plane", "explore", "model_for",
]
