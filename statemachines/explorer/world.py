"""One explored state: both planes, the network, the schedulers' phases and
the bookkeeping the checks need."""
from __future__ import annotations

from ..plane import ControlPlane
from .messages import Message

# A request's phase in each turn's scheduler.  Plain ints: they enter the
# canonical state, whose order (symmetry reduction sorts by repr) must not
# depend on how a phase prints.
NEW, ARRIVED, ALLOCATED, LOADING, RUNNING, FINISHED, ABORTED, DEAD, SENT = range(9)
# SENT: P granted the lease and the params are on their way to D, which is
# stalled; D's NewRequest is a ``messages.Params`` in flight.


def clone_plane(p: ControlPlane) -> ControlPlane:
    """A copy of a plane's semantic state (see ControlPlane.clone)."""
    return p.clone()


class Clocks:
    """Each plane's clock: D's is the model's time, P's is D's plus ``skew``."""

    __slots__ = ("skew",)

    def __init__(self, skew: float):
        self.skew = {"D": 0.0, "P": float(skew)}

    def now(self, w: "World", plane: str) -> float:
        return w.t + self.skew[plane]

    def offset(self, plane: str, engine: str) -> float:
        """The clock offset a handshake with ``engine`` measures (remote - local)."""
        return self.skew[engine] - self.skew[plane]


class World:
    """Mutable while a move is applied; cloned (cheaply) before each move."""

    __slots__ = ("t", "planes", "owned", "net", "stalled", "phase", "phase2", "faults", "aborts", "crashed",
                 "restarted", "awaited", "reported", "freed", "activity", "hold_expiry", "stall", "p_expiry", "ahead",
                 "canon_parts", "canon_net")
    t: float
    planes: dict[str, ControlPlane]
    owned: set[str]  # the planes this world no longer shares with the one it was cloned from
    net: tuple[Message, ...]
    stalled: tuple[Message, ...]
    phase: list[int]
    phase2: list[int]
    faults: int
    aborts: int
    crashed: bool
    # After D restarted: the leases P granted for its old incarnation's requests.
    restarted: frozenset[str] | None
    awaited: frozenset[tuple[str, str]]  # (plane, request id)
    reported: frozenset[tuple[str, str]]
    freed: frozenset[tuple[str, str]]
    activity: dict[tuple[str, str], float]  # (plane, engine) -> time
    hold_expiry: list[float | None]
    stall: tuple[float, float] | None
    p_expiry: list[float | None]
    # (move, the world after it, its canonical key): a successor the search
    # computed ahead (on a liveness drain), taken when this world is
    # expanded instead of applying the move again.  Never copied by clone.
    ahead: tuple | None
    # The canonical state's parts of this world's planes and network
    # (canonical.py), taken over by its clones: a plane or a network a move
    # leaves alone keeps its parts.
    canon_parts: tuple | None
    canon_net: tuple | None

    def clone(self) -> "World":
        w = World.__new__(World)
        w.t = self.t
        # Copy-on-write: a move usually touches one plane, often none.
        w.planes = dict(self.planes)
        w.owned = set()
        w.net = self.net
        w.stalled = self.stalled
        w.phase = list(self.phase)
        w.phase2 = list(self.phase2)
        w.faults, w.aborts, w.crashed = self.faults, self.aborts, self.crashed
        w.restarted = self.restarted
        w.awaited, w.reported, w.freed = self.awaited, self.reported, self.freed
        w.activity = dict(self.activity)
        w.hold_expiry = list(self.hold_expiry)
        w.stall = self.stall
        w.p_expiry = list(self.p_expiry)
        w.ahead = None
        w.canon_parts, w.canon_net = self.canon_parts, self.canon_net
        return w

    def plane(self, name: str) -> ControlPlane:
        """The plane, copied first if this world still shares it."""
        if name not in self.owned:
            self.planes[name] = clone_plane(self.planes[name])
            self.owned.add(name)
            return self.planes[name]
        plane = self.planes[name]
        parts = self.canon_parts
        if parts is not None and any(part is not None and part.plane is plane for part in parts):
            # Changed in place after its parts were taken (a drain): those
            # parts go, the other plane's stay.
            self.canon_parts = tuple(None if part is not None and part.plane is plane else part for part in parts)
        return plane
