"""PlaneDriver: the ControlPlane wired to a real (or loopback) transport.

The one place where the pure core meets I/O.  ``feed`` hands a stimulus
to the plane and executes the actions it returns; ``step`` polls the world
(handshake results, notifications, transfer states, due timers) and does
the same.  Only the thread that calls ``step``/``feed`` touches the plane;
handshakes run on a small pool and come back through a queue.

Transport failures become events (ReadFailed, WriteFailed,
HandshakeFailed, PeerDisconnected), so the machines decide what they mean.
Malformed notifications are counted and logged, never raised.
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter, deque
from typing import Any, Callable

from statemachines import actions as A
from statemachines import events as E
from statemachines.config import PlaneConfig
from statemachines.plane import HEARTBEAT_REQUESTER, ControlPlane
from transport.errors import PeerDisconnected as PeerGone
from transport.errors import TransportError
from transport.handshake import HandshakeServer, build_payload
from transport.wire import (
    CompletionNotif, HeartbeatNotif, MalformedNotification, PushRegNotif, encode_completion, encode_heartbeat,
    encode_push_reg, decode_notif,
)

from .handshaker import Handshaker

log = logging.getLogger("kvplane.driver")


class PlaneDriver:
    def __init__(
        self,
        *,
        engine_id: str,
        endpoint: Any,
        config: PlaneConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        compat_hash: str = "kvplane-v1",
        host: str = "127.0.0.1",
        port: int = 0,
        drop_notifications: float = 0.0,
        seed: int = 0,
        curve_keypair: tuple[bytes, bytes] | None = None,
        server_public_keys: dict[str, bytes] | None = None,
    ):
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.config = config or PlaneConfig()
        self.clock = clock
        self.compat_hash = compat_hash
        self.plane = ControlPlane(self.config)
        self.directory: dict[str, str] = {}  # engine id -> side-channel url
        self.agents: dict[str, str] = {}  # engine id -> NIXL remote agent name
        self.engine_of_agent: dict[str, str] = {}
        self.layouts: dict[str, dict] = {}  # engine id -> remote cache layout
        self.xfers: dict[str, tuple[Any, str, str]] = {}  # request id -> (handle, "READ"|"WRITE", engine)
        self.server = HandshakeServer(f"tcp://{host}:{port}", self._handshake_payload, curve_keypair=curve_keypair,
                                      clock=clock)
        # CURVE: our side channel's keypair, and the public key of each peer
        # whose side channel is authenticated (engine id -> key).
        self._server_keys = dict(server_public_keys or {})
        self.handshaker = Handshaker(compat_hash, self.config.handshake_timeout, clock=clock)
        self._drop_rate = drop_notifications
        self._rng = random.Random(seed)
        # What the scheduler collects (vLLM: finished_sending / finished_recving).
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.load_error_blocks: set[int] = set()
        self.finished_sending: set[str] = set()
        self.freed: list[tuple[str, tuple, str]] = []
        self.counters: Counter = Counter()

    # --------------------------------------------------------------- setup
    @property
    def side_channel_url(self) -> str:
        return self.server.url

    @property
    def side_channel_port(self) -> int:
        return int(self.server.url.rsplit(":", 1)[1])

    def learn_engine(self, engine_id: str, url: str, server_public_key: bytes | None = None) -> None:
        """Where to handshake with ``engine_id`` (from kv_transfer_params or
        PUSH_REG), and its side channel's CURVE public key if it has one."""
        self.directory[engine_id] = url
        if server_public_key is not None:
            self._server_keys[engine_id] = server_public_key

    def _handshake_payload(self, pp_rank: int, tp_rank: int) -> dict | None:
        if tp_rank != 0 or pp_rank != 0:
            return None
        return build_payload(engine_id=self.engine_id, compat_hash=self.compat_hash, tp_rank=tp_rank,
                             metadata=self.endpoint.local_metadata(), cache=self.endpoint.describe_cache())

    # --------------------------------------------------------------- input
    def feed(self, event: E.Event) -> None:
        self._run([event])

    def step(self) -> int:
        """Poll everything once; returns how many stimuli were processed."""
        self.server.poll_once(0)
        # Deadlines first: after a stall (a slow or SIGSTOPped process) a
        # transfer that overran its deadline must fail before its completion
        # is polled, or it would be accepted although the peer may already
        # have reclaimed the blocks under it.
        n = self._fire_due()
        events: list[E.Event] = []
        for outcome in self.handshaker.completed():
            events.append(self._handshake_event(outcome))
        events.extend(self._notif_events())
        events.extend(self._transfer_events())
        n += len(events)
        self._run(events)
        return n + self._fire_due()

    def _fire_due(self) -> int:
        now = self.clock()
        dl = self.plane.next_deadline()
        if dl is None or dl > now:
            return 0
        self._run(self._execute(self.plane.fire_due(now)))
        return 1

    def disconnect_idle_engines(self, reason: str = "shutdown") -> int:
        """Close every connected engine no request references (graceful
        shutdown), so the plane, and its event log, end holding no remote
        agent.  Returns how many were closed."""
        hb = self.plane.heartbeats
        # The heartbeat batcher keeps its reference until its next tick even
        # with nothing left to send; such an engine is idle too.
        idle = [key for key, e in self.plane.instances["remote_engine"].items()
                if e.state in ("CONNECTED", "STALE")
                and all(kind == HEARTBEAT_REQUESTER and not hb.registered(key) for kind, _ in e.refs)]
        for key in idle:
            self.feed(E.PeerDisconnected(engine_id=key, reason=reason))
        return len(idle)

    def close(self) -> None:
        for handle, _, _ in self.xfers.values():
            self._release(handle)
        self.xfers.clear()
        self.handshaker.close()
        self.server.close()

    # --------------------------------------------------------------- loop
    def _run(self, events: list[E.Event]) -> None:
        # FIFO with O(1) pops: one poll may bring tens of thousands of events
        # (a large heartbeat batch), and list.pop(0) made a step quadratic.
        pending = deque(events)
        while pending:
            event = pending.popleft()
            pending.extend(self._execute(self.plane.handle(event, self.clock())))

    def _execute(self, actions: list) -> list[E.Event]:
        """Carry out actions; returns the events their failures produce (also fed)."""
        follow: list[E.Event] = []
        for a in actions:
            handler = _HANDLERS.get(type(a))
            if handler is None:  # a new action type without a handler is a bug
                raise TypeError(f"no transport handler for {type(a).__name__}")
            handler(self, a, follow)
        return follow

    # --------------------------------------------------------------- handlers
    def _start_handshake(self, a: A.StartHandshake, follow: list) -> None:
        url = self.directory.get(a.engine_id)
        if url is None:
            follow.append(E.HandshakeFailed(engine_id=a.engine_id, reason="no side-channel address known"))
            return
        self.counters["handshakes_started"] += 1
        self.handshaker.submit(a.engine_id, url, server_public_key=self._server_keys.get(a.engine_id))

    def _handshake_event(self, outcome) -> E.Event:
        if outcome.error is not None:
            self.counters["handshakes_failed"] += 1
            log.warning("handshake with %s at %s failed: %s", outcome.engine_id, outcome.url, outcome.error)
            return E.HandshakeFailed(engine_id=outcome.engine_id, reason=f"{type(outcome.error).__name__}: {outcome.error}")
        result = outcome.result
        try:
            name = self.endpoint.add_remote(result.metadata)
        except (TransportError, ValueError) as exc:
            self.counters["handshakes_failed"] += 1
            return E.HandshakeFailed(engine_id=outcome.engine_id, reason=f"add_remote: {exc}")
        self.agents[outcome.engine_id] = name
        self.engine_of_agent[name] = outcome.engine_id
        self.layouts[outcome.engine_id] = result.cache
        self.counters["handshakes_ok"] += 1
        samples = [(s.offset, s.rtt) for s in (result.samples or (result.sample,))]
        return E.HandshakeOk(engine_id=outcome.engine_id, samples=samples)

    def _remove_agent(self, a: A.RemoveRemoteAgent, follow: list) -> None:
        self.counters["engines_evicted"] += 1
        name = self.agents.pop(a.engine_id, None)
        self.layouts.pop(a.engine_id, None)
        if name is None:
            return
        self.engine_of_agent.pop(name, None)
        try:
            self.endpoint.remove_remote(name)
        except TransportError as exc:
            log.info("remove_remote %s: %s", name, exc)

    def _post(self, a, follow: list, op: str) -> None:
        failed = E.ReadFailed if op == "READ" else E.WriteFailed
        name = self.agents.get(a.engine_id)
        if name is None:
            follow.append(failed(request_id=a.request_id, reason=f"engine {a.engine_id} has no remote agent"))
            return
        if op == "READ":
            notif = encode_completion(a.remote_request_id, a.expected_consumers)
            post = self.endpoint.post_read
        else:
            notif = encode_completion(a.remote_request_id, 1)
            post = self.endpoint.post_write
        remote_ids, local_ids = _align_tail(list(a.remote_block_ids), list(a.local_block_ids))
        try:
            handle = post(name, self.layouts[a.engine_id], remote_ids, local_ids, notif)
        except (TransportError, ValueError) as exc:
            follow.append(failed(request_id=a.request_id, reason=f"{type(exc).__name__}: {exc}"))
            if isinstance(exc, PeerGone):
                follow.append(E.PeerDisconnected(engine_id=a.engine_id, reason=str(exc)))
            return
        self.counters[f"{op.lower()}s_posted"] += 1
        self.xfers[a.request_id] = (handle, op, a.engine_id)

    def _post_read(self, a: A.PostRead, follow: list) -> None:
        self._post(a, follow, "READ")

    def _post_write(self, a: A.PostWrite, follow: list) -> None:
        self._post(a, follow, "WRITE")

    def _release_xfer(self, a: A.ReleaseXfer, follow: list) -> None:
        entry = self.xfers.pop(a.request_id, None)
        if entry is not None:
            if a.cancel:
                self.counters["transfers_cancelled"] += 1
            self._release(entry[0])

    def _release(self, handle) -> None:
        try:
            self.endpoint.release(handle, missing_ok=True)
        except TransportError as exc:
            log.info("release of transfer %s: %s", getattr(handle, "id", "?"), exc)

    def _notify(self, engine_id: str, msg: bytes, follow: list, what: str) -> None:
        name = self.agents.get(engine_id)
        if name is None:
            self.counters[f"{what}_unsent_not_connected"] += 1
            return
        try:
            self.endpoint.send_notif(name, msg)
            self.counters[f"{what}_sent"] += 1
        except PeerGone as exc:
            self.counters[f"{what}_failed"] += 1
            follow.append(E.PeerDisconnected(engine_id=engine_id, reason=str(exc)))
        except TransportError as exc:
            self.counters[f"{what}_failed"] += 1
            log.info("%s to %s: %s", what, engine_id, exc)

    def _send_notif(self, a: A.SendNotif, follow: list) -> None:
        self._notify(a.engine_id, encode_completion(a.remote_request_id, a.expected_consumers), follow, "notifs")

    def _send_heartbeat(self, a: A.SendHeartbeat, follow: list) -> None:
        # Every rank of the engine gets the batch; this driver connects rank 0.
        self._notify(a.engine_id, encode_heartbeat(a.request_ids), follow, "heartbeats")

    def _send_push_reg(self, a: A.SendPushRegistration, follow: list) -> None:
        host, port = self.side_channel_url[len("tcp://"):].rsplit(":", 1)
        reg = {"request_id": a.remote_request_id, "engine_id": self.engine_id, "decode_request_id": a.request_id,
               "block_ids": list(a.block_ids), "host": host, "port": int(port)}
        if a.deadline is not None:
            # When we give up (our clock); P bounds its WRITE by it.
            reg["deadline"] = float(a.deadline)
        self._notify(a.engine_id, encode_push_reg(reg), follow, "push_regs")

    def _report_recv(self, a: A.ReportRecv, follow: list) -> None:
        if a.ok:
            self.finished_recving.add(a.request_id)
        else:
            self.failed_recving.add(a.request_id)
            self.load_error_blocks.update(a.failed_block_ids)

    def _free_blocks(self, a: A.FreeBlocks, follow: list) -> None:
        self.counters[f"blocks_freed_{a.reason}"] += len(a.block_ids)
        self.freed.append((a.request_id, a.block_ids, a.reason))
        self.finished_sending.add(a.request_id)

    # --------------------------------------------------------------- polling
    def _notif_events(self) -> list[E.Event]:
        try:
            got = self.endpoint.poll_notifs()
        except TransportError as exc:
            log.warning("poll_notifs: %s", exc)
            return []
        events: list[E.Event] = []
        for agent, msg in got:
            if self._drop_rate and self._rng.random() < self._drop_rate:
                self.counters["notifs_dropped_injected"] += 1
                continue
            try:
                notif = decode_notif(msg)
            except MalformedNotification as exc:
                self.counters["notifs_malformed"] += 1
                log.warning("ignored malformed notification from %s: %s", agent, exc)
                continue
            self.counters["notifs_received"] += 1
            events.extend(self._notif_to_events(agent, notif))
            engine = self.engine_of_agent.get(agent)
            if engine is not None and self.plane.get("remote_engine", engine) is not None:
                events.append(E.EngineActivity(engine_id=engine))
        return events

    def _notif_to_events(self, agent: str, notif) -> list[E.Event]:
        if isinstance(notif, HeartbeatNotif):
            self.counters["heartbeats_received"] += 1
            return [E.LeaseHeartbeat(request_id=rid) for rid in notif.request_ids]
        if isinstance(notif, CompletionNotif):
            reader = self.plane.get("decode_request", notif.request_id)
            if reader is not None and reader.state == "AWAITING_PUSH":
                return [E.PushDone(request_id=notif.request_id)]
            return [E.ConsumerDone(request_id=notif.request_id, consumer=agent,
                                   expected_consumers=notif.expected_consumers)]
        if isinstance(notif, PushRegNotif):
            reg = notif.registration
            try:
                url = f"tcp://{reg['host']}:{int(reg['port'])}"
                event = E.PushRegistered(request_id=str(reg["request_id"]), engine_id=str(reg["engine_id"]),
                                         remote_request_id=str(reg["decode_request_id"]),
                                         remote_block_ids=[int(b) for b in reg["block_ids"]],
                                         remote_deadline=_push_deadline(reg))
            except (KeyError, TypeError, ValueError) as exc:
                self.counters["notifs_malformed"] += 1
                log.warning("ignored PUSH_REG from %s with a bad registration: %r", agent, exc)
                return []
            self.learn_engine(event.engine_id, url)
            return [event]
        return []

    def _transfer_events(self) -> list[E.Event]:
        events: list[E.Event] = []
        for request_id, (handle, op, engine) in list(self.xfers.items()):
            done, failed = (E.ReadDone, E.ReadFailed) if op == "READ" else (E.WriteDone, E.WriteFailed)
            try:
                state = self.endpoint.poll_transfer(handle)
            except PeerGone as exc:
                events += [failed(request_id=request_id, reason=str(exc)), E.PeerDisconnected(engine_id=engine, reason=str(exc))]
                continue
            except TransportError as exc:
                events.append(failed(request_id=request_id, reason=f"{type(exc).__name__}: {exc}"))
                continue
            if state == "DONE":
                self.counters[f"{op.lower()}s_done"] += 1
                layout = self.layouts.get(engine, {})
                self.counters["bytes_moved"] += (
                    handle.num_blocks * layout.get("block_size", 0) * len(layout.get("base_addrs", ()))
                )
                events.append(done(request_id=request_id))
        return events


def _push_deadline(reg: dict) -> float | None:
    """The decoder's give-up time in a PUSH_REG (its clock); None when the
    registration has none (an older decoder).  Anything but a finite number
    is a malformed registration."""
    deadline = reg.get("deadline")
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
        raise ValueError(f"PUSH_REG deadline must be a finite number, got {deadline!r}")
    return float(deadline)


def _align_tail(remote: list, local: list) -> tuple[list, list]:
    """Pair the two block lists from the end of the prompt.

    On a prefix hit the consumer allocates (and registers) only the blocks it
    lacks, while the producer's params name every block of the prompt; the
    missing ones are the tail, as in vLLM's NixlConnector.  Whichever list is
    longer is the producer's and is cut to its last len(shorter) blocks.
    """
    n = min(len(remote), len(local))
    return remote[len(remote) - n:], local[len(local) - n:]


_HANDLERS: dict[type, Callable] = {
    A.StartHandshake: PlaneDriver._start_handshake,
    A.RemoveRemoteAgent: PlaneDriver._remove_agent,
    A.PostRead: PlaneDriver._post_read,
    A.PostWrite: PlaneDriver._post_write,
    A.ReleaseXfer: PlaneDriver._release_xfer,
    A.SendNotif: PlaneDriver._send_notif,
    A.SendHeartbeat: PlaneDriver._send_heartbeat,
    A.SendPushRegistration: PlaneDriver._send_push_reg,
    A.ReportRecv: PlaneDriver._report_recv,
    A.FreeBlocks: PlaneDriver._free_blocks,
}
