"""What an exploration covers: request profiles, faults, bounds, plane timings."""
from __future__ import annotations

import attrs

from ..config import PlaneConfig

# Small durations keep the interesting interleavings within a few ticks.  An
# engine goes STALE after 3 s of silence and is evicted after 6 (engine_stale_after
# pins the scale the explored paths and the mutation tests were built on, and
# heartbeat_spread=False the whole-second heartbeat times and the state counts
# docs/design-review.md states; tests/test_heartbeat_spread_explorer.py explores the
# spread schedule, the plane's default).
EXPLORER_PLANE_CONFIG = PlaneConfig(
    kv_lease_duration=6.0, decoder_kv_blocks_ttl=8.0, expiry_safety_margin=5.0, engine_ttl=6.0,
    engine_stale_after=3.0, heartbeat_spread=False,
    handshake_timeout=2.0, handshake_backoff=1.0, handshake_max_attempts=2, transfer_timeout=4.0,
    recv_timeout=10.0, push_registration_timeout=4.0,
)


@attrs.frozen
class Profile:
    """One request's shape: how many tokens D reads, whether D's scheduler
    awaits the recv, and whether a turn 2 (P reads D's held blocks) or a
    push (P WRITEs into D's registered blocks) follows."""

    name: str
    num_remote_tokens: int
    awaiting: bool
    turn2: bool = False
    push: bool = False


PROFILES = {
    "read": Profile("read", 4, True),
    "hit": Profile("hit", 0, True),  # full prefix hit, awaited: notify P, report done
    "notify": Profile("notify", 0, False),  # full prefix hit nobody awaits
    "read2": Profile("read2", 4, True, turn2=True),  # read, hold blocks, P reads them back
    "push": Profile("push", 4, True, push=True),  # D registers, P WRITEs from its lease
}

FAULTS = frozenset({"lose", "dup", "hs_fail", "hs_hang", "read_fail", "read_hang", "write_fail", "write_hang",
                    "crash"})
# D stalls (SIGSTOP, overload): for up to ``ExploreConfig.stall`` seconds D's
# loop does nothing while P's clock and timers run on.  Not in the default
# fault set (it multiplies the state space); ``kvplane explore --stall``.
STALL_FAULTS = FAULTS | {"stall"}
# D restarts: its process dies and starts again at once with the same engine
# id (a new incarnation: nothing of the old one's state).  Not in the default set.
RESTART_FAULTS = FAULTS | {"restart"}
# The faults of the rank world (``ranks``): a lost or duplicated completion
# notification (one rank's), a heartbeat lost to one P rank only (a Tick
# variant), failed or hung handshakes and READs, and one rank crashing.
RANK_FAULTS = frozenset({"lose", "dup", "hs_fail", "read_fail", "read_hang", "crash"})
# The engine world's: the rank faults but a crash (a dead worker takes vLLM's engine with it).
ENGINE_FAULTS = RANK_FAULTS - {"crash"}


@attrs.frozen
class ExploreConfig:
    requests: tuple = ("read", "hit")
    max_faults: int = 1
    max_aborts: int = 1
    faults: frozenset = FAULTS
    skew: float = 0.0  # P's clock minus D's
    stall: float = 6.0  # longest D stall (the "stall" fault), seconds
    max_depth: int = 10
    max_states: int = 300_000
    symmetry: bool = True
    liveness: bool = True
    stop_at_first: bool = True
    drain_limit: int = 400
    plane: PlaneConfig = EXPLORER_PLANE_CONFIG
    # (P's TP, D's TP): one plane per worker rank (``ranks.RankModel``), D
    # rank r reading the P ranks ``TpMapping`` names.  None: one plane a side.
    ranks: tuple[int, int] | None = None
    # The engine world (``engine_model``): vLLM's scheduler drives the
    # engine_request machine of each side over the rank world (``ranks``).
    engine: bool = False
    max_preemptions: int = 1  # the engine world's preemptions (budgeted like aborts)
