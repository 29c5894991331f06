"""Two sides' event logs as one time line of typed records: what a sequence
diagram draws (``sequence_mermaid`` turns it into text).

Each log is one plane (P or D).  Every record becomes zero or more items:
``Arrow`` for what crosses the wire (READ/WRITE posts and completions,
notifications, heartbeat batches, PUSH_REG, handshakes) and ``Note`` for
what one side decides (lease grant / extension / expiry / free, timer
firings, aborts, failed recvs).  A message is drawn once: at its send where
the sender's log records one (a heartbeat batch is one arrow per batch and
rank, not per id), otherwise at its receipt.

D's times are moved onto P's clock with the handshake's clock offset (the
lowest-RTT sample of a ``HandshakeOk``, as the remote_engine machine keeps
it): P's estimate of D when P's log has one, else D's estimate of P.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from enum import StrEnum

import attrs
from kvplane.statemachines.eventlog import EventLog, LogRecord

P, D = "P", "D"
SIDES = (P, D)
ENGINE_MACHINE = "engine_request:"  # the scheduler half's lines (its own log, merged into its side's)


def engine_pid(side: str) -> str:
    """The engine (vLLM's scheduler) calling a side's scheduler half."""
    return f"{side}_engine"


def has_engine_calls(log: "SideLog") -> bool:
    return any(r.machine is not None and r.machine.startswith(ENGINE_MACHINE) for r in log.records)
PROXY = "proxy"
DEFAULT_MAX_EVENTS = 300

# An exported lease name is "<request id>-<32 hex digits>" (PlaneDriver.export_lease).
_EXPORTED = re.compile(r"(.+)-[0-9a-f]{32}\Z")


class Kind(StrEnum):
    """What an item shows; tests and filters select by it."""

    REQUEST = "request"
    PARAMS = "params"
    HANDSHAKE = "handshake"
    HANDSHAKE_OK = "handshake_ok"
    HANDSHAKE_FAILED = "handshake_failed"
    DISCONNECT = "disconnect"
    HEARTBEAT = "heartbeat"
    READ = "read"
    READ_DONE = "read_done"
    READ_FAILED = "read_failed"
    WRITE = "write"
    WRITE_DONE = "write_done"
    WRITE_FAILED = "write_failed"
    PUSH_REG = "push_reg"
    NOTIF = "notif"
    GRANT = "grant"
    EXTEND = "extend"
    EXPIRE = "expire"
    FREE = "free"
    TIMER = "timer"
    ABORT = "abort"
    RECV_FAILED = "recv_failed"
    REFUSED = "refused"
    CANCEL = "cancel"
    LOG_END = "log_end"
    ENGINE = "engine"  # the engine's call on the scheduler half, and its answer (the scheduler's log)


class Line(StrEnum):
    """How an arrow is drawn: a send, a completion coming back, a failure."""

    SEND = "send"
    REPLY = "reply"
    FAILED = "failed"


@attrs.frozen
class Participant:
    id: str  # a Mermaid identifier
    label: str
    side: str  # P, D or proxy


@attrs.frozen
class Arrow:
    t: float  # seconds since the start of the merged time line
    src: str
    dst: str
    text: str
    kind: Kind
    line: Line = Line.SEND
    request_ids: tuple[str, ...] = ()
    side: str = P  # whose log recorded it
    # Caused by something the peer sent (a receipt): at equal times it goes after the peer's items.
    received: bool = False


@attrs.frozen
class Note:
    t: float
    over: tuple[str, ...]  # one participant, or the first and last of a span
    text: str
    kind: Kind
    request_ids: tuple[str, ...] = ()
    side: str = P
    received: bool = False


Item = Arrow | Note


@attrs.frozen
class ClockCorrection:
    """What was added to D's times to put them on P's clock; ``shift`` None: no offset was known."""

    shift: float | None
    source: str

    def describe(self) -> str:
        if self.shift is None:
            return "no clock offset known: D's times are used as recorded"
        return f"D's times shifted by {self.shift:+.6f} s onto P's clock ({self.source})"


@attrs.frozen
class SideLog:
    """One side's log as given: its records and, for the header, where it came from."""

    side: str
    records: tuple[LogRecord, ...]
    source: str = ""
    torn_tail: int | None = None  # the line number of a torn last line left out (a killed writer)


@attrs.frozen
class Selection:
    """Which part of the time line to draw."""

    request_ids: tuple[str, ...] = ()  # empty: every request
    start: float | None = None  # seconds since the merged start
    end: float | None = None
    max_events: int = DEFAULT_MAX_EVENTS
    proxy: bool = False  # draw the proxy that forwards kv_transfer_params


@attrs.frozen
class SequenceDiagram:
    participants: tuple[Participant, ...]
    items: tuple[Item, ...]
    clock: ClockCorrection
    t0: float  # the merged start, in P's clock
    left_out: int  # items past max_events
    logs: tuple[SideLog, ...]
    selection: Selection
    engines: dict = attrs.Factory(dict)  # side -> engine id, where the logs name it

    @property
    def arrows(self) -> list[Arrow]:
        return [i for i in self.items if isinstance(i, Arrow)]

    @property
    def notes(self) -> list[Note]:
        return [i for i in self.items if isinstance(i, Note)]


# ------------------------------------------------------------------ helpers
def short_id(name: str) -> str:
    """The readable part of an exported lease name (drops the unguessable suffix)."""
    m = _EXPORTED.match(name)
    return m.group(1) if m else name


def _ids_text(ids: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(short_id(i) for i in ids[:most])
    return shown + (f" +{len(ids) - most}" if len(ids) > most else "")


def _actions(r: LogRecord) -> list[tuple[str, dict]]:
    return [(name, data) for name, data in (r.actions or ())]


def _peer(side: str) -> str:
    return D if side == P else P


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def best_offset(records: Iterable[LogRecord], engine: str | None = None) -> float | None:
    """The lowest-RTT finite (offset, rtt) sample of the log's HandshakeOk
    records (remote clock minus local), as the remote_engine machine picks it."""
    best = None
    for r in records:
        if type(r.event).__name__ != "HandshakeOk" or (engine is not None and r.event.engine_id != engine):
            continue
        for sample in r.event.samples:
            usable = len(sample) == 2 and all(_finite(x) for x in sample) and sample[1] >= 0
            if usable and (best is None or sample[1] < best[1]):
                best = (float(sample[0]), float(sample[1]))
    return None if best is None else best[0]


def looks_like(records: Sequence[LogRecord]) -> str | None:
    """Which side a log's content says it is: P grants renewable leases
    (turn 1) and reads only D's fixed-TTL holds; D reads renewable leases
    and grants fixed-TTL holds.  None when the log does not tell."""
    p_signs = d_signs = 0
    for r in records:
        name = type(r.event).__name__
        if name == "LeaseGranted":
            if r.event.renewable:
                p_signs += 1
            else:
                d_signs += 1
        elif name == "NewRequest":
            if r.event.remote_renewable:
                d_signs += 1
            else:
                p_signs += 1
    return P if p_signs > d_signs else D if d_signs > p_signs else None


def engine_ids(logs: dict[str, SideLog]) -> dict[str, str]:
    """Each side's engine id as its peer's log names it (NewRequest, heartbeat
    senders, remote_engine machines)."""
    found: dict[str, str] = {}
    for side, log in logs.items():
        for r in log.records:
            ev = r.event
            name = type(ev).__name__
            peer_id = None
            if name in ("NewRequest", "PushRegistered", "HandshakeOk", "HandshakeFailed", "PeerDisconnected"):
                peer_id = ev.engine_id
            elif name == "LeaseHeartbeat":
                peer_id = ev.sender
            elif name == "ConsumerDone":
                peer_id = ev.consumer
            if peer_id:
                found.setdefault(_peer(side), peer_id)
                break
    return found


def clock_correction(logs: dict[str, SideLog], engines: dict[str, str]) -> ClockCorrection:
    if P in logs:
        off = best_offset(logs[P].records, engines.get(D))
        if off is not None:  # D - P
            return ClockCorrection(0.0 - off, f"P's handshake with D estimated D - P = {off:+.6f} s")
    if D in logs:
        off = best_offset(logs[D].records, engines.get(P))
        if off is not None:  # P - D
            return ClockCorrection(off, f"D's handshake with P estimated P - D = {off:+.6f} s")
    return ClockCorrection(None, "")


def _ranks(logs: dict[str, SideLog]) -> dict[str, list[int]]:
    """The ranks of each side that its peer's log addresses."""
    seen: dict[str, set[int]] = {s: set() for s in SIDES}
    for side, log in logs.items():
        for r in log.records:
            if type(r.event).__name__ == "NewRequest":
                seen[_peer(side)].update(r.event.remote_ranks)
            for name, a in _actions(r):
                if name == "SendHeartbeat":
                    seen[_peer(side)].update(a.get("ranks", ()))
    return {s: sorted(v) or [0] for s, v in seen.items()}


# ------------------------------------------------------------------ linking requests
class _Links:
    """Request ids of both sides joined into one group per request: a D request
    and its P lease through remote_request_id (kv_transfer_params), an exported
    lease name and its request id."""

    def __init__(self):
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)

    def add(self, name: str) -> None:
        self.find(name)
        base = short_id(name)
        if base != name:
            self.join(name, base)

    def group(self, names: Iterable[str]) -> set[str]:
        for n in names:
            self.add(n)
        roots = {self.find(n) for n in names}
        return {x for x in self.parent if self.find(x) in roots}


def _link(logs: dict[str, SideLog]) -> _Links:
    links = _Links()
    for log in logs.values():
        for r in log.records:
            ev = r.event
            rid = getattr(ev, "request_id", None)
            if isinstance(rid, str):
                links.add(rid)
                remote = getattr(ev, "remote_request_id", None)
                if isinstance(remote, str):
                    links.add(remote)
                    links.join(rid, remote)
            for _, a in _actions(r):
                rid, remote = a.get("request_id"), a.get("remote_request_id")
                if isinstance(rid, str) and isinstance(remote, str):
                    links.add(rid)
                    links.add(remote)
                    links.join(rid, remote)
    return links


# ------------------------------------------------------------------ records -> items
# Stimuli that something the peer did brings (its message, or the completion
# of a transfer with it).
FROM_PEER = frozenset({"ConsumerDone", "LeaseHeartbeat", "ReadDone", "ReadFailed", "WriteDone", "WriteFailed",
                       "PushDone", "PushRegistered", "HandshakeOk", "HandshakeFailed", "PeerDisconnected"})

class _Builder:
    def __init__(self, logs: dict[str, SideLog], ranks: dict[str, list[int]], proxy: bool, shift: float | None):
        self.logs = logs
        self.shift = shift  # D's clock onto P's; None: unknown
        self.ranks = ranks
        self.proxy = proxy
        # Messages a sender's log records: drawn at the send, so the receipt is not drawn again.
        # (The receiver knows a lease by its request id, the sender by its exported name.)
        self.sent_notifs = {(s, short_id(a["remote_request_id"])) for s, log in logs.items() for r in log.records
                            for n, a in _actions(r) if n == "SendNotif"}
        self.sent_regs = {(s, short_id(a["request_id"])) for s, log in logs.items() for r in log.records
                          for n, a in _actions(r) if n == "SendPushRegistration"}
        self.sends_heartbeats = {s for s, log in logs.items() for r in log.records
                                 if any(n == "SendHeartbeat" for n, _ in _actions(r))}
        # The remote ranks of each request (NewRequest), which its READs go to.
        self.requests_ranks = {(side, r.event.request_id): tuple(r.event.remote_ranks)
                               for side, log in logs.items() for r in log.records
                               if type(r.event).__name__ == "NewRequest"}

    def pid(self, side: str, rank: int | None = None) -> str:
        ranks = self.ranks[side]
        if len(ranks) == 1:
            return side
        return f"{side}_r{ranks[0] if rank is None else rank}"

    def span(self, side: str) -> tuple[str, ...]:
        ranks = self.ranks[side]
        return (side,) if len(ranks) == 1 else (self.pid(side, ranks[0]), self.pid(side, ranks[-1]))

    def targets(self, side: str, ranks: Iterable[int] | None) -> list[str]:
        if len(self.ranks[side]) == 1:
            return [side]
        return [self.pid(side, k) for k in (ranks or (self.ranks[side][0],))]

    def items(self, side: str, records: Sequence[LogRecord], shift: float) -> list[Item]:
        out: list[Item] = []
        i = 0
        while i < len(records):
            r = records[i]
            if type(r.event).__name__ == "LeaseHeartbeat":
                # One notification's ids arrive as consecutive LeaseHeartbeat lines.
                j = i
                while (j + 1 < len(records) and type(records[j + 1].event).__name__ == "LeaseHeartbeat"
                       and records[j + 1].event.sender == r.event.sender and records[j + 1].t - r.t < 0.05):
                    j += 1
                out += [attrs.evolve(x, received=True)
                        for x in self.heartbeat_receipt(side, records[i:j + 1], r.t + shift)]
                i = j + 1
                continue
            items = self.record(side, r, r.t + shift)
            if type(r.event).__name__ in FROM_PEER:
                items = [attrs.evolve(x, received=True) for x in items]
            out += items
            i += 1
        return out

    def heartbeat_receipt(self, side: str, group: Sequence[LogRecord], t: float) -> list[Item]:
        peer = _peer(side)
        ids = tuple(g.event.request_id for g in group)
        out: list[Item] = []
        if peer not in self.sends_heartbeats:
            out.append(Arrow(t, self.pid(peer), self.pid(side), f"HB x{len(ids)}: {_ids_text(ids)}", Kind.HEARTBEAT,
                             request_ids=ids, side=side))
        extended = [(g.event.request_id, a["at"]) for g in group for n, a in _actions(g) if n == "ArmTimer"]
        refused = [g.event.request_id for g in group for n, _ in _actions(g) if n.startswith("Refuse")]
        unknown = [g.event.request_id for g in group if g.recorded and g.state_after is None]
        parts = []
        if extended:
            ext_ids = [e[0] for e in extended]
            parts.append(f"extends {_ids_text(ext_ids)} (expires in {max(e[1] for e in extended) - group[0].t:.1f} s)")
        else:
            parts.append("no deadline moved")
        if refused:
            parts.append(f"refused {_ids_text(refused)}")
        if unknown:
            parts.append(f"unknown {_ids_text(unknown)}")
        out.append(Note(t, self.span(side), f"HB for {len(ids)} lease(s): " + "; ".join(parts), Kind.EXTEND,
                        ids, side))
        return out

    def engine_call(self, side: str, r: LogRecord, t: float) -> list[Item]:
        """A line of the scheduler half's log: the engine's call and what the
        connector answered and sent its ranks, or a report the ranks made."""
        ev = r.event
        name = type(ev).__name__
        engine, me = engine_pid(side), self.pid(side)
        ids = (ev.request_id,)
        acts = _actions(r)
        if name in ("RecvFinished", "SendingFinished"):
            text = ("finished_recving" + ("" if ev.ok else " (failed)")) if name == "RecvFinished" else "finished_sending"
            return [Arrow(t, me, engine, f"{text} {short_id(ev.request_id)}", Kind.ENGINE, Line.REPLY, ids, side)]
        if name == "TimerFired":
            sent = [n for n, _ in acts if n not in ("ArmTimer", "CancelTimer")]
            return [Note(t, (me,), f"{short_id(ev.request_id if hasattr(ev, 'request_id') else r.machine)} overdue: "
                         f"{', '.join(sent) or 'nothing'}", Kind.TIMER, ids, side)]
        call = name[len("Engine"):] if name.startswith("Engine") else name
        answers = [n for n, _ in acts if n.startswith("Answer")]
        records = [n for n, _ in acts if n.startswith(("Send", "Grant"))]
        text = f"{call} {short_id(ev.request_id)}"
        if answers:
            text += f" → {', '.join(a[len('Answer'):] for a in answers)}"
        if records:
            text += f"; ranks: {', '.join(records)}"
        line = Line.SEND if r.state_before != r.state_after or answers or records else Line.REPLY
        return [Arrow(t, engine, me, text, Kind.ENGINE, line, ids, side)]

    def record(self, side: str, r: LogRecord, t: float) -> list[Item]:
        if r.machine is not None and r.machine.startswith(ENGINE_MACHINE):
            return self.engine_call(side, r, t)
        ev = r.event
        name = type(ev).__name__
        peer = _peer(side)
        me, them = self.pid(side), self.pid(peer)
        here = self.span(side)
        out: list[Item] = []
        rid = getattr(ev, "request_id", None)
        ids = (rid,) if isinstance(rid, str) else ()

        def note(text: str, kind: Kind, request_ids: tuple[str, ...] = ids) -> None:
            out.append(Note(t, here, text, kind, request_ids, side))

        def arrow(src: str, dst: str, text: str, kind: Kind, line: Line = Line.SEND,
                  request_ids: tuple[str, ...] = ids) -> None:
            out.append(Arrow(t, src, dst, text, kind, line, request_ids, side))

        if name == "LeaseGranted":
            arm = next((a["at"] for n, a in _actions(r) if n == "ArmTimer"), None)
            until = f", expires in {arm - r.t:.1f} s" if _finite(arm) else ""
            if ev.renewable:
                note(f"lease {rid} granted: {len(ev.block_ids)} block(s){until}", Kind.GRANT)
            else:
                note(f"hold {rid} for turn 2: {len(ev.block_ids)} block(s){until} (fixed TTL)", Kind.GRANT)
            if self.proxy:
                arrow(me, PROXY, f"kv_transfer_params of {rid}", Kind.PARAMS)
        elif name == "NewRequest":
            text = f"request {rid} (reads {short_id(ev.remote_request_id)}{self.valid_for(side, ev, r.t)})"
            ids = (rid, ev.remote_request_id)
            if self.proxy:
                arrow(PROXY, me, text, Kind.REQUEST, request_ids=ids)
            else:
                note("new " + text, Kind.REQUEST, ids)
        elif name == "ConsumerDone":
            text = f"notif {short_id(rid)}:{ev.expected_consumers}"
            if (peer, short_id(rid)) not in self.sent_notifs:
                arrow(them, me, text, Kind.NOTIF)
            else:
                note(text + " received", Kind.NOTIF)
        elif name == "ReadDone":
            arrow(them, me, f"READ {rid} complete", Kind.READ_DONE, Line.REPLY)
        elif name == "ReadFailed":
            arrow(them, me, f"READ {rid} failed: {ev.reason or '?'}", Kind.READ_FAILED, Line.FAILED)
        elif name == "WriteDone":
            arrow(them, me, f"WRITE {rid} complete", Kind.WRITE_DONE, Line.REPLY)
        elif name == "WriteFailed":
            arrow(them, me, f"WRITE {rid} failed: {ev.reason or '?'}", Kind.WRITE_FAILED, Line.FAILED)
        elif name == "PushDone":
            arrow(them, me, f"notif: WRITE into {rid} done", Kind.NOTIF)
        elif name == "PushRegistered":
            if (peer, short_id(ev.remote_request_id)) not in self.sent_regs:
                arrow(them, me, f"PUSH_REG {short_id(ev.remote_request_id)} ({len(ev.remote_block_ids)} block(s))",
                      Kind.PUSH_REG, request_ids=(rid, ev.remote_request_id))
        elif name == "HandshakeOk":
            off = best_offset([r])
            extra = "" if off is None else f", clock offset {side}-{peer} {0.0 - off:+.6f} s"
            arrow(them, me, f"handshake ok{extra}", Kind.HANDSHAKE_OK, Line.REPLY, ())
        elif name == "HandshakeFailed":
            arrow(them, me, f"handshake failed: {ev.reason or '?'}", Kind.HANDSHAKE_FAILED, Line.FAILED, ())
        elif name == "PeerDisconnected":
            note(f"{ev.engine_id} disconnected: {ev.reason or '?'} (from {r.state_before} to {r.state_after})",
                 Kind.DISCONNECT, ())
        elif name in ("Abort", "LeaseAbort", "PushAbort"):
            note(f"abort {rid}", Kind.ABORT)
        elif name == "TimerFired" and ev.kind != "heartbeat":
            key = str(ev.key)
            tid = (key,)
            if ev.kind == "lease" and r.state_after == "EXPIRED":
                note(f"timer: lease {key} expired", Kind.EXPIRE, tid)
            elif r.state_before != r.state_after:
                note(f"timer {ev.kind} {key}: from {r.state_before} to {r.state_after}", Kind.TIMER, tid)
        for aname, a in _actions(r):
            out += self.action(side, aname, a, t, f"{name} in {r.state_before}")
        return out

    def valid_for(self, side: str, ev, t: float) -> str:
        """How long the remote blocks stay valid, in words: their expiry is
        in the remote's clock, moved onto ours with the known offset."""
        if not _finite(ev.remote_expiry) or self.shift is None:
            return ""
        local = ev.remote_expiry + (self.shift if side == P else -self.shift)
        return f", valid for {local - t:.2f} s" + ("" if ev.remote_renewable else " (fixed TTL)")

    def action(self, side: str, name: str, a: dict, t: float, cause: str = "") -> list[Item]:
        peer = _peer(side)
        me = self.pid(side)
        rid = a.get("request_id")
        ids = tuple(x for x in (rid, a.get("remote_request_id")) if isinstance(x, str))
        if name == "PostRead":
            text = f"READ {rid} from {short_id(a['remote_request_id'])} ({len(a['local_block_ids'])} block(s))"
            ranks = self.requests_ranks.get((side, rid))
            return [Arrow(t, me, dst, text, Kind.READ, Line.SEND, ids, side) for dst in self.targets(peer, ranks)]
        if name == "PostWrite":
            text = f"WRITE {rid} into {short_id(a['remote_request_id'])} ({len(a['local_block_ids'])} block(s))"
            return [Arrow(t, me, self.pid(peer), text, Kind.WRITE, Line.SEND, ids, side)]
        if name == "SendHeartbeat":
            hb = tuple(a["request_ids"])
            text = f"HB x{len(hb)}: {_ids_text(hb)}"
            return [Arrow(t, me, dst, text, Kind.HEARTBEAT, Line.SEND, hb, side)
                    for dst in self.targets(peer, a.get("ranks"))]
        if name == "SendNotif":
            text = f"notif {short_id(a['remote_request_id'])}:{a.get('expected_consumers', 1)} (notify-only)"
            return [Arrow(t, me, self.pid(peer), text, Kind.NOTIF, Line.SEND, ids, side)]
        if name == "SendPushRegistration":
            text = f"PUSH_REG {rid} ({len(a['block_ids'])} block(s))"
            return [Arrow(t, me, self.pid(peer), text, Kind.PUSH_REG, Line.SEND, ids, side)]
        if name == "StartHandshake":
            return [Arrow(t, me, self.pid(peer), f"handshake (attempt {a.get('attempt')})", Kind.HANDSHAKE,
                          Line.SEND, (), side)]
        if name == "FreeBlocks":
            reason = f" ({a['reason']})" if a.get("reason") else ""
            return [Note(t, self.span(side), f"free {rid}: {len(a['block_ids'])} block(s){reason}", Kind.FREE, ids,
                         side)]
        if name == "ReportRecv" and not a.get("ok", True):
            return [Note(t, self.span(side), f"recv {rid} failed ({cause}): recompute", Kind.RECV_FAILED, ids, side)]
        if name == "GrantHold":
            return [Note(t, self.span(side), f"hold {rid} for turn 2: {len(a['block_ids'])} block(s) (fixed TTL)",
                         Kind.GRANT, ids, side)]
        if name.startswith("Refuse"):
            return [Note(t, self.span(side), f"refused {a.get('sender')} for {rid}: {a.get('reason')}",
                         Kind.REFUSED, ids, side)]
        if name == "ReleaseXfer" and a.get("cancel"):
            return [Note(t, self.span(side), f"cancel transfer {rid}", Kind.CANCEL, ids, side)]
        return []


# ------------------------------------------------------------------ the diagram
def sides_of(p: EventLog | None, d: EventLog | None, p_source: str = "", d_source: str = "") -> dict[str, SideLog]:
    out = {}
    if p is not None:
        out[P] = SideLog(P, p.records, p_source)
    if d is not None:
        out[D] = SideLog(D, d.records, d_source)
    return out


# A log that stops this long before the other's: its process died or hung there.
LOG_END_GAP = 1.0


def _log_ends(logs: dict[str, SideLog], shift: dict[str, float], b: _Builder) -> dict[str, Note]:
    ends = {side: log.records[-1].t + shift[side] for side, log in logs.items() if log.records}
    if len(ends) < 2:
        return {}
    last = max(ends.values())
    return {side: Note(t, b.span(side), f"no more records in {side}'s log", Kind.LOG_END, (), side)
            for side, t in ends.items() if t < last - LOG_END_GAP}


def merge(p_items: Sequence[Item], d_items: Sequence[Item]) -> list[Item]:
    """One time line of two, each kept in its log's order.  At equal times
    a receipt waits for the other side's items (a hand-driven or coarse
    clock gives a READ and its completion notification one time)."""
    out: list[Item] = []
    i = j = 0
    while i < len(p_items) and j < len(d_items):
        a, b = p_items[i], d_items[j]
        if a.t < b.t or (a.t == b.t and not (a.received and not b.received)):
            out.append(a)
            i += 1
        else:
            out.append(b)
            j += 1
    return out + list(p_items[i:]) + list(d_items[j:])


def build(logs: dict[str, SideLog], selection: Selection | None = None) -> SequenceDiagram:
    """The diagram model of the logs (``{"P": SideLog, "D": SideLog}``; either may be missing)."""
    selection = selection or Selection()
    engines = engine_ids(logs)
    clock = clock_correction(logs, engines)
    ranks = _ranks(logs)
    b = _Builder(logs, ranks, selection.proxy, clock.shift)
    shift = {P: 0.0, D: clock.shift or 0.0}
    per_side = {side: b.items(side, logs[side].records, shift[side]) if side in logs else [] for side in SIDES}
    for side, end in _log_ends(logs, shift, b).items():
        per_side[side].append(end)
    merged = merge(per_side[P], per_side[D])
    t0 = merged[0].t if merged else 0.0
    items = [attrs.evolve(item, t=item.t - t0) for item in merged]
    if selection.request_ids:
        group = _link(logs).group(selection.request_ids)
        items = [_for_group(i, group) for i in items if not i.request_ids or group.intersection(i.request_ids)]
    if selection.start is not None:
        items = [i for i in items if i.t >= selection.start]
    if selection.end is not None:
        items = [i for i in items if i.t <= selection.end]
    left_out = max(0, len(items) - selection.max_events)
    items = items[:selection.max_events]
    participants = []
    if selection.proxy:
        participants.append(Participant(PROXY, "proxy", PROXY))
    calls = {side for side in SIDES if side in logs and has_engine_calls(logs[side])}
    if P in calls:
        participants.append(Participant(engine_pid(P), "P's engine (scheduler)", P))
    for side in SIDES:
        engine = engines.get(side)
        label = f"{side} ({engine})" if engine and engine != side else side
        if len(ranks[side]) == 1:
            participants.append(Participant(side, label, side))
        else:
            participants += [Participant(b.pid(side, k), f"{label} rank {k}", side) for k in ranks[side]]
    if D in calls:
        participants.append(Participant(engine_pid(D), "D's engine (scheduler)", D))
    return SequenceDiagram(tuple(participants), tuple(items), clock, t0, left_out, tuple(logs.values()),
                           selection, engines)


def _for_group(item: Item, group: set[str]) -> Item:
    """A batch (heartbeats) that carries other requests too names the selected ones."""
    if item.kind not in (Kind.HEARTBEAT, Kind.EXTEND) or len(item.request_ids) < 2:
        return item
    mine = [i for i in item.request_ids if i in group]
    return attrs.evolve(item, text=f"{item.text} (incl. {_ids_text(mine)})")


def link_group(logs: dict[str, SideLog], request_ids: Iterable[str]) -> set[str]:
    """Every id of both sides that belongs to the same requests as ``request_ids``."""
    return _link(logs).group(list(request_ids))


def known_ids(logs: dict[str, SideLog]) -> set[str]:
    return set(_link(logs).parent)
