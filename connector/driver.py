"""PlaneDriver: the ControlPlane wired to a real (or loopback) transport.

The one place where the pure core meets I/O.  ``feed`` hands a stimulus
to the plane and executes the actions it returns; ``step`` polls the world
(handshake results, notifications, transfer states, due timers) and does
the same.  Only the thread that calls ``step``/``feed`` touches the plane;
handshakes run on a small pool and come back through a queue.

Transport failures become events (ReadFailed, WriteFailed,
HandshakeFailed, PeerDisconnected), so the machines decide what they mean.
Malformed notifications are counted and logged, never raised.

Authentication (see transport/handshake.py for the threat model): the
driver has one CURVE keypair, its side channel's server key and its client
key for handshakes with peers.  ``trust_peer(engine_id, public_key)`` does
both halves for a peer: it may fetch our metadata, and its server must
prove that key.  Notifications are accepted only from agents the driver
knows (a trusted peer, whose NIXL agent is named by its engine id, or an
agent added through a handshake) and name a lease only through the
unguessable name ``export_lease`` gave it; the lease machine then binds
the lease to its consumers.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections import Counter, OrderedDict, deque
from typing import Any, Callable

import attrs
import zmq

from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machines.heartbeat import KIND as HEARTBEAT
from kvplane.statemachines.plane import ControlPlane
from kvplane.transport.block_sizes import BLOCK_TOKENS, BlockMappingError, BlockShape, pairs_for_read
from kvplane.transport.endpoint import Endpoint
from kvplane.transport.errors import PeerDisconnected as PeerGone
from kvplane.transport.errors import TransportError
from kvplane.transport.layer_slice import LAYER_SLICE, LayerSlice, local_first_region
from kvplane.statemachines.machines.lease import HELD as LEASE_HELD
from kvplane.statemachines.machines.lease import admits
from kvplane.statemachines.machines.remote_engine import UP as ENGINE_UP
from kvplane.transport import wire
from kvplane.transport.handshake import HandshakeServer, build_payload, public_key
from kvplane.transport.wire import (
    CompletionNotif, HeartbeatNotif, MalformedNotification, PushRegistration, PushRegNotif, encode_completion,
    encode_heartbeats, encode_push_reg, decode_notif,
)

from .handshaker import Handshaker
from .push_auth import push_reg_vouched, sign_push_reg
from .ranks import base_engine_id, rank_of

log = logging.getLogger("kvplane.driver")

# Completions for a lease name not adopted yet (see PlaneDriver._keep_early).
EARLY_KEEP_S = 5.0
EARLY_MAX = 4096
MAX_EARLY_PER_NAME = 64
# The side channel's name for a client holding a deployment key.
DEPLOYMENT_MEMBER = "kvplane-deployment"


@attrs.define
class _Early:
    at: float
    completions: list = attrs.Factory(list)  # (sender engine, expected consumers)


class PlaneDriver:
    def __init__(
        self,
        *,
        engine_id: str,
        endpoint: Endpoint,
        config: PlaneConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        compat_hash: str = "kvplane-v1",
        host: str = "127.0.0.1",
        port: int = 0,
        curve_keypair: tuple[bytes, bytes] | None = None,
        trusted_peers: dict[str, Any] | None = None,
        server_public_keys: dict[str, bytes] | None = None,
        insecure: bool = False,
        tp_rank: int = 0,
        deployment_keys: tuple = (),
        machines: dict[str, Any] | None = None,
        push_reg_mac_keys: tuple[bytes, ...] = (),
    ):
        """``curve_keypair`` (public, secret; z85): this engine's CURVE key,
        generated when not given.  ``trusted_peers``: engine id -> its public
        key (z85 text or bytes, or a ``zmq.auth`` certificate path), see
        ``trust_peer``.  ``server_public_keys``: engine id -> the key of a
        peer's side channel that does not fetch from us.  ``insecure=True``
        (tests, benchmarks): no CURVE on our side channel, plaintext to peers
        whose key we lack, and, while no peer is trusted, notifications
        accepted from any agent.  Fault injection (lost notifications) wraps
        the endpoint (``kvplane.transport.faults``); the driver has none.
        ``tp_rank``: the rank this driver serves (one driver per worker rank;
        its side channel answers that rank only).  ``deployment_keys``: the
        CURVE public keys every engine of the deployment shares (its secret,
        ``connector.secret``): they may fetch our metadata, and any agent
        may notify us, since it can only have reached our agent with the
        metadata our side channel hands to key holders; leases still bind
        their consumers.  A peer named
        ``"<engine>/tp<r>"`` (``ranks``) is trusted, and its server key
        known, through its engine's entry: the ranks share the key."""
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        # This process's incarnation of the engine: named in our handshake
        # replies and (through RankInfo) in the params our scheduler signs, so
        # a reader of our blocks can tell us from a restart under our engine id.
        # Its start time first (ns, fixed-width hex): a reader that finds an
        # older incarnation connected than its params name handshakes afresh.
        self.incarnation = f"{time.time_ns():016x}-{secrets.token_hex(4)}"
        self.endpoint = endpoint
        self.config = config or PlaneConfig()
        self.clock = clock
        self.compat_hash = compat_hash
        # ``machines``: the plane's (default: every machine), e.g. some of
        # them wrapped by ``observe.observed`` to count their transitions.
        self.plane = ControlPlane(self.config, machines=machines)
        self.directory: dict[str, str] = {}  # engine id -> side-channel url
        self.agents: dict[str, str] = {}  # engine id -> NIXL remote agent name
        self.engine_of_agent: dict[str, str] = {}
        self.layouts: dict[str, dict] = {}  # engine id -> remote cache layout
        self.xfers: dict[str, tuple[Any, str, str]] = {}  # request id -> (handle, "READ"|"WRITE", engine)
        # Request id -> (remote part, local part) of each block it moves, as
        # (index, of): a TP reader reads only its heads (tp_mapping).
        self.parts: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
        # This rank's block as rows of token slots (set by an embedder whose
        # peers' blocks may hold another number of tokens: vLLM's --block-size).
        self.block_shape: BlockShape | None = None
        # The model's layers this rank's regions are (set by an embedder whose
        # engine runs pipeline parallel: each stage holds a slice; None: all).
        self.layer_slice: LayerSlice | None = None
        self.insecure = insecure
        if insecure and curve_keypair is not None:
            raise ValueError("curve_keypair and insecure=True are exclusive")
        if insecure:
            log.warning("%s: insecure side channel and notifications (insecure=True): tests and benchmarks only",
                        engine_id)
            self.keypair: tuple[bytes, bytes] | None = None
        else:
            pub, secret = curve_keypair or zmq.curve_keypair()
            # z85 text (from a config file) or bytes; the secret is never logged.
            self.keypair = (public_key(pub), secret.encode("ascii") if isinstance(secret, str) else bytes(secret))
        # Peers we trust: engine id -> public key (None: named only, insecure).
        self._trusted: dict[str, bytes | None] = {}
        # The public key each peer's side channel must prove (engine id -> key).
        self._server_keys = {e: public_key(k) for e, k in (server_public_keys or {}).items()}
        self.server = HandshakeServer(f"tcp://{host}:{port}", self._handshake_payload, curve_keypair=self.keypair,
                                      insecure=insecure, clock=clock)
        self.handshaker = Handshaker(compat_hash, self.config.handshake_timeout, clock=clock,
                                     client_keypair=self.keypair, insecure=insecure)
        for peer, key in (trusted_peers or {}).items():
            self.trust_peer(peer, key)
        self._deployment = bool(deployment_keys)
        # The deployment's MAC keys (the first signs): PUSH_REGs are signed and
        # only verified ones admitted (push_auth).  Empty: no MAC either way.
        self._push_reg_mac_keys = tuple(push_reg_mac_keys)
        for key in deployment_keys:
            self.server.allow_client(key, DEPLOYMENT_MEMBER)
        # Lease names: what P exports as the remote request id (a capability:
        # the request id plus 128 random bits), both ways.
        self._lease_name: dict[str, str] = {}
        self._lease_of_name: dict[str, str] = {}
        self._early: OrderedDict[str, _Early] = OrderedDict()  # lease name -> completions before its grant
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

    @property
    def public_key(self) -> bytes | None:
        """Our CURVE public key (z85), for peers to trust; None when insecure."""
        return self.keypair[0] if self.keypair is not None else None

    def trust_peer(self, engine_id: str, key: Any = None) -> None:
        """Trust engine ``engine_id`` holding CURVE public ``key``: it may
        fetch our metadata (allow-list), its side channel must prove the key,
        and its agent may send us notifications.  ``key`` None names a peer
        without a key (insecure drivers only)."""
        if key is None:
            if not self.insecure:
                raise ValueError(f"trust_peer({engine_id!r}): an authenticated driver needs the peer's public key")
            self._trusted[engine_id] = None
            return
        key = public_key(key)
        self._trusted[engine_id] = key
        self._server_keys[engine_id] = key
        if not self.insecure:
            self.server.allow_client(key, engine_id)

    def learn_engine(self, engine_id: str, url: str, server_public_key: bytes | None = None) -> None:
        """Where to handshake with ``engine_id`` (from kv_transfer_params or
        PUSH_REG), and its side channel's CURVE public key if it has one."""
        self.directory[engine_id] = url
        if server_public_key is not None:
            self._server_keys[engine_id] = public_key(server_public_key)

    def adopt_lease_name(self, request_id: str, name: str) -> bool:
        """Name our lease on ``request_id`` ``name`` (the scheduler made the
        name and handed it to the consumer; every rank adopts the same one).
        False, and nothing named, when no lease is held for it."""
        if self.plane.get("lease", request_id) is None or name in self._lease_of_name:
            return False
        old = self._lease_name.pop(request_id, None)
        if old is not None:
            self._lease_of_name.pop(old, None)
        self._lease_name[request_id] = name
        self._lease_of_name[name] = request_id
        early = self._early.pop(name, None)
        if early is not None:
            self.counters["completions_early_replayed"] += len(early.completions)
            self._run([E.ConsumerDone(request_id=request_id, consumer=sender, expected_consumers=n)
                       for sender, n in early.completions])
        return True

    def _keep_early(self, name: str, sender: str, expected_consumers: int) -> None:
        """Keep a completion naming a lease we do not hold yet: with the
        scheduler in another process, the grant reaches this rank with the
        next step's metadata, and a fast reader may finish before that.  It
        is replayed when the name is adopted and dropped (counted) after
        ``EARLY_KEEP_S`` or past ``EARLY_MAX`` names, so a forger costs a
        bounded buffer; the lease machine still checks the sender."""
        now = self.clock()
        early = self._early
        while early:
            oldest = next(iter(early.values()))
            if now - oldest.at <= EARLY_KEEP_S and len(early) < EARLY_MAX:
                break
            early.popitem(last=False)
            self.counters["completions_early_dropped"] += 1
        entry = early.get(name)
        if entry is None:
            entry = early[name] = _Early(at=now)
        if len(entry.completions) < MAX_EARLY_PER_NAME:
            entry.completions.append((sender, expected_consumers))

    def export_lease(self, request_id: str) -> str:
        """The name under which a peer refers to our lease on ``request_id``
        (the remote request id of kv_transfer_params): unguessable, so only
        a peer that was handed the params can heartbeat or complete it."""
        name = self._lease_name.get(request_id)
        if name is None:
            name = f"{request_id}-{secrets.token_hex(16)}"
            if self.plane.get("lease", request_id) is not None:  # else nothing to name: stays unknown
                self._lease_name[request_id] = name
                self._lease_of_name[name] = request_id
        return name

    def _forget_lease_name(self, request_id: str) -> None:
        if self.plane.get("lease", request_id) is None:
            name = self._lease_name.pop(request_id, None)
            if name is not None:
                self._lease_of_name.pop(name, None)

    def _sender_engine(self, agent: str) -> str | None:
        """The engine a notification's agent is, or None: not one we know."""
        engine = self.engine_of_agent.get(agent)
        if engine is not None:
            return engine
        if agent in self._trusted or base_engine_id(agent) in self._trusted:
            return agent  # a peer's NIXL agent is named by its engine id (a rank's: by its rank engine id)
        if self._deployment or (self.insecure and not self._trusted):
            return agent
        return None

    def _server_key(self, engine_id: str) -> bytes | None:
        key = self._server_keys.get(engine_id)
        return key if key is not None else self._server_keys.get(base_engine_id(engine_id))

    def _handshake_payload(self, pp_rank: int, tp_rank: int) -> dict | None:
        if tp_rank != self.tp_rank or pp_rank != 0:
            return None
        return build_payload(engine_id=self.engine_id, compat_hash=self.compat_hash, tp_rank=tp_rank,
                             metadata=self.endpoint.local_metadata(), cache=self._cache_description(),
                             incarnation=self.incarnation)

    def _cache_description(self) -> dict:
        """The endpoint's cache layout, with its blocks' tokens where the
        embedder set them (a peer with blocks of another size reads by slices)."""
        cache = self.endpoint.describe_cache()
        if self.block_shape is not None:
            cache = dict(cache, **{BLOCK_TOKENS: self.block_shape.tokens})
        if self.layer_slice is not None and not self.layer_slice.whole:  # a reader puts our regions at its first
            cache = dict(cache, **{LAYER_SLICE: self.layer_slice.to_list()})
        return cache

    # --------------------------------------------------------------- input
    def feed(self, event: E.Event) -> None:
        self._run([event])

    def step(self, side_channel: bool = True, transfers: bool = True, notifications: bool = True) -> int:
        """Poll everything once; returns how many stimuli were processed.
        ``side_channel=False`` leaves our handshake server unpolled (the
        engine's per-step poll: its ticker serves the side channel);
        ``transfers=False`` our transfers' states (a ticker beside an engine
        that polls them every step); ``notifications=False`` the agent's
        notifications (NIXL's call for them progresses UCX: tens of µs)."""
        if side_channel:
            self.server.poll_once(0)
        # Deadlines first: after a stall (a slow or SIGSTOPped process) a
        # transfer that overran its deadline must fail before its completion
        # is polled, or it would be accepted although the peer may already
        # have reclaimed the blocks under it.
        n = self._fire_due()
        events: list[E.Event] = []
        for outcome in self.handshaker.completed():
            events.append(self._handshake_event(outcome))
        if notifications:
            events.extend(self._notif_events())
        if transfers:
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
        # A heartbeat batch keeps its reference until its next tick even
        # with nothing left to send; such an engine is idle too.
        idle = [key for key, e in self.plane.instances["remote_engine"].items()
                if e.state in ENGINE_UP
                and all(kind == HEARTBEAT and not hb.registered(key) for kind, _ in e.refs)]
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
        key = self._server_key(a.engine_id)
        if key is None and not self.insecure:
            self.counters["handshakes_refused_no_key"] += 1
            log.warning("%s: no CURVE public key known for engine %s: not handshaking (trust_peer it first)",
                        self.engine_id, a.engine_id)
            follow.append(E.HandshakeFailed(engine_id=a.engine_id, reason="no CURVE public key known for the engine"))
            return
        self.counters["handshakes_started"] += 1
        self.handshaker.submit(a.engine_id, url, tp_rank=rank_of(a.engine_id), server_public_key=key)

    def _handshake_event(self, outcome) -> E.Event:
        if outcome.error is not None:
            self.counters["handshakes_failed"] += 1
            log.warning("%s: handshake with %s at %s failed: %s; %s", self.engine_id, outcome.engine_id, outcome.url,
                        outcome.error, self._retry_words(outcome.engine_id))
            return E.HandshakeFailed(engine_id=outcome.engine_id, reason=f"{type(outcome.error).__name__}: {outcome.error}")
        result = outcome.result
        incarnation = result.payload.get("incarnation")
        problem = None if incarnation is None else wire.name_problem(incarnation, "incarnation")
        if problem is not None:  # before add_remote: a peer that says odd things gets no agent of ours
            self.counters["handshakes_failed"] += 1
            return E.HandshakeFailed(engine_id=outcome.engine_id, reason=f"handshake reply: {problem}")
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
        return E.HandshakeOk(engine_id=outcome.engine_id, samples=samples, incarnation=incarnation)

    def _retry_words(self, engine_id: str) -> str:
        """What the remote_engine machine does with the failure: its
        requesters recompute, and it backs off (before the failure is fed)."""
        engine = self.plane.get("remote_engine", engine_id)
        if engine is None:
            return "no handshake in progress"
        cfg = self.config
        delay = cfg.handshake_backoff * 2 ** (min(engine.attempts, cfg.handshake_max_attempts) - 1)
        return f"its requests recompute; no new attempt for {delay:g} s (consecutive failure {engine.attempts})"

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
        parts = self.parts.get(a.request_id)
        try:
            remote = self.layouts[a.engine_id]
            # A peer holding a layer slice (a PP stage): its regions go to ours from its first layer.
            first_region = local_first_region(remote, len(self.endpoint.describe_cache()["base_addrs"]),
                                              self.layer_slice)
            if self.block_shape is not None and remote.get(BLOCK_TOKENS, self.block_shape.tokens) != \
                    self.block_shape.tokens:
                # Blocks of another number of tokens (P's --block-size): slice by slice.
                if op != "READ" or parts is not None or first_region is not None:
                    raise BlockMappingError("blocks of unlike sizes move by READ, without a TP head split or a "
                                            "layer slice")
                slices = pairs_for_read(self.block_shape, self.endpoint.describe_cache()["block_size"],
                                        remote[BLOCK_TOKENS], remote["block_size"], list(a.local_block_ids),
                                        list(a.remote_block_ids))
                handle = self.endpoint.post_read_slices(name, remote, slices, notif)
            elif parts is None:
                handle = post(name, remote, remote_ids, local_ids, notif, local_first_region=first_region)
            else:
                handle = post(name, remote, remote_ids, local_ids, notif,
                              remote_part=parts[0], local_part=parts[1], local_first_region=first_region)
        except (TransportError, ValueError) as exc:
            # A refused post (a block id past the peer's pool, a layout that
            # does not pair, a gone peer) fails this transfer only.
            self._count_and_warn(f"{op.lower()}s_refused", "%s %s of %s from %s refused: %s", self.engine_id, op,
                                 a.request_id, a.engine_id, exc)
            follow.append(failed(request_id=a.request_id, reason=f"{type(exc).__name__}: {exc}"))
            if isinstance(exc, PeerGone):
                follow.append(E.PeerDisconnected(engine_id=a.engine_id, reason=str(exc)))
                if op == "READ":
                    follow.extend(self._farewell(a.request_id))
            return
        self.counters[f"{op.lower()}s_posted"] += 1
        self.xfers[a.request_id] = (handle, op, a.engine_id)

    def _farewell(self, request_id: str) -> list[E.Event]:
        """Events that tell the holder of a lease we failed to READ (its agent
        is gone) that we are done with it.  The agent we hold may be a past
        incarnation of the engine (it restarted under the same engine id and
        granted the lease since): a notify-only request on the same lease,
        fed after the engine's eviction, handshakes afresh (the new agent's
        metadata) and sends the completion, so the holder frees the blocks
        now instead of at expiry.  If the engine is really gone, the
        handshake fails and the request ends; either way it holds nothing."""
        r = self.plane.get("decode_request", request_id)
        if r is None:
            return []
        self.counters["farewells"] += 1
        rid = f"{request_id}#farewell"
        return [E.NewRequest(request_id=rid, engine_id=r.engine_id, remote_request_id=r.remote_request_id,
                             remote_ranks=r.ranks, expected_consumers=r.expected_consumers,
                             remote_expiry=r.remote_expiry, remote_renewable=r.remote_renewable,
                             remote_incarnation=r.remote_incarnation),
                E.BlocksAllocated(request_id=rid, num_remote_tokens=0, awaiting=False),
                E.StartLoad(request_id=rid)]

    def _post_read(self, a: A.PostRead, follow: list) -> None:
        self._post(a, follow, "READ")

    def _post_write(self, a: A.PostWrite, follow: list) -> None:
        self._post(a, follow, "WRITE")

    def _release_xfer(self, a: A.ReleaseXfer, follow: list) -> None:
        entry = self.xfers.pop(a.request_id, None)
        self.parts.pop(a.request_id, None)
        if entry is not None:
            if a.cancel:
                self.counters["transfers_cancelled"] += 1
            self._release(entry[0])
            if a.cancel and entry[1] == "READ":
                # A READ cut in flight may still land (seen after a link-down partition healed):
                # close the connection to its peer so it cannot; the next request handshakes again.
                follow.append(E.PeerDisconnected(engine_id=entry[2], reason="a READ cut in flight"))

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
        # More ids than one HB: may carry go out as several messages.
        for msg in encode_heartbeats(a.request_ids):
            self._notify(a.engine_id, msg, follow, "heartbeats")

    def _send_push_reg(self, a: A.SendPushRegistration, follow: list) -> None:
        try:
            # deadline: when we give up (our clock); P bounds its WRITE by it.
            reg = PushRegistration.at_side_channel(
                self.side_channel_url, request_id=a.remote_request_id, engine_id=self.engine_id,
                decode_request_id=a.request_id, block_ids=a.block_ids, deadline=a.deadline)
            if self._push_reg_mac_keys:
                reg = sign_push_reg(reg, self._push_reg_mac_keys[0])
        except ValueError as exc:  # e.g. a request id no notification can carry: D's push times out
            self.counters["push_regs_unencodable"] += 1
            log.warning("cannot send PUSH_REG for %s: %s", a.request_id, exc)
            return
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
        self._forget_lease_name(a.request_id)

    def _refused(self, a: A.RefuseNotification, follow: list) -> None:
        self._count_and_warn(f"refused_{a.reason}", "%s refused a notification from %.64r: %s",
                             a.request_id, a.sender, a.reason)

    def _count_and_warn(self, counter: str, fmt: str, *args: Any) -> None:
        """Count a refused input; log the first few and then every 1000th, so
        a flood of forgeries costs a counter, not a log line each."""
        n = self.counters[counter] = self.counters[counter] + 1
        if n <= 10 or n % 1000 == 0:
            log.warning(f"{fmt} (%s #%d)", *args, counter, n)

    # --------------------------------------------------------------- polling
    def _notif_events(self) -> list[E.Event]:
        try:
            got = self.endpoint.poll_notifs()
        except TransportError as exc:
            log.warning("poll_notifs: %s", exc)
            return []
        events: list[E.Event] = []
        for agent, msg in got:
            sender = self._sender_engine(agent)
            if sender is None:
                # Not an engine we trust or handshook with: whatever it says.
                self._count_and_warn("notifs_unknown_sender", "ignored a notification from unknown agent %.64r", agent)
                continue
            try:
                notif = decode_notif(msg)
            except MalformedNotification as exc:
                self._count_and_warn("notifs_malformed", "ignored malformed notification from %.64r: %s", agent, exc)
                continue
            self.counters["notifs_received"] += 1
            events.extend(self._notif_to_events(sender, notif))
            engine = self.engine_of_agent.get(agent)
            if engine is not None and self.plane.get("remote_engine", engine) is not None:
                events.append(E.EngineActivity(engine_id=engine))
        return events

    def _lease_named(self, name: str) -> str | None:
        """Our request id of the lease a peer names, or None (counted): a
        name we never exported, or one whose lease has ended."""
        rid = self._lease_of_name.get(name)
        if rid is None:
            self.counters["notifs_unknown_lease"] += 1
        return rid

    def _notif_to_events(self, sender: str, notif) -> list[E.Event]:
        """``sender``: the engine the notification came from (checked)."""
        if isinstance(notif, HeartbeatNotif):
            self.counters["heartbeats_received"] += 1
            rids = [self._lease_named(name) for name in notif.request_ids]
            return [E.LeaseHeartbeat(request_id=rid, sender=sender) for rid in rids if rid is not None]
        if isinstance(notif, CompletionNotif):
            # A completion naming one of our decode requests is a push WRITE
            # into it (its table ignores one it does not await); any other
            # names a lease a consumer READ from.
            # Who may say so is the table's rule (decode_request refuses a
            # completion not from the engine the request reads).
            if self.plane.get("decode_request", notif.request_id) is not None:
                return [E.PushDone(request_id=notif.request_id, sender=sender)]
            rid = self._lease_named(notif.request_id)
            if rid is None:
                self._keep_early(notif.request_id, sender, notif.expected_consumers)
                return []
            return [E.ConsumerDone(request_id=rid, consumer=sender, expected_consumers=notif.expected_consumers)]
        if isinstance(notif, PushRegNotif):
            reg = notif.registration  # validated by the decoder
            event = E.PushRegistered(request_id=reg.request_id, engine_id=reg.engine_id,
                                     remote_request_id=reg.decode_request_id, remote_block_ids=reg.block_ids,
                                     remote_deadline=reg.deadline)
            if self._push_reg_mac_keys and not push_reg_vouched(reg, self._push_reg_mac_keys):
                self._count_and_warn("push_regs_refused_unauthenticated",
                                     "ignored PUSH_REG from %.64r: no valid MAC of the deployment", sender)
                return []
            admitted = self._admit_push_reg(sender, event, reg.side_channel)
            return [] if admitted is None else [admitted]
        return []

    def _admit_push_reg(self, sender: str, event: E.PushRegistered, url: str) -> E.PushRegistered | None:
        """A registration may only come from the engine it names, for a lease
        we hold that admits that engine; only then does its address enter
        the directory.  Otherwise a counted, logged ignore."""
        why = None
        rid = self._lease_of_name.get(event.request_id)
        lease = self.plane.get("lease", rid) if rid is not None else None
        if event.engine_id != sender:
            why = "names another engine"
        elif rid is None or lease is None or lease.state not in LEASE_HELD:
            why = "names no lease we hold"
        elif not admits(lease, sender):
            why = "the lease is bound to other consumers"
        if why is not None:
            self._count_and_warn("push_regs_refused", "ignored PUSH_REG from %.64r: %s", sender, why)
            return None
        assert rid is not None  # no lease: refused above
        # In a deployment (one secret) D's side channel proves the deployment's
        # key, our own: P WRITEs only into an engine of the deployment (vLLM's
        # push mode).  With per-engine keys, a trusted peer's key stays.
        key = self.keypair[0] if self._deployment and self.keypair is not None else None
        self.learn_engine(sender, url, server_public_key=key if self._server_key(sender) is None else None)
        return attrs.evolve(event, request_id=rid)

    def _transfer_events(self) -> list[E.Event]:
        events: list[E.Event] = []
        for request_id, (handle, op, engine) in list(self.xfers.items()):
            done, failed = (E.ReadDone, E.ReadFailed) if op == "READ" else (E.WriteDone, E.WriteFailed)
            try:
                state = self.endpoint.poll_transfer(handle)
            except PeerGone as exc:
                events += [failed(request_id=request_id, reason=str(exc)), E.PeerDisconnected(engine_id=engine, reason=str(exc))]
                if op == "READ":
                    events += self._farewell(request_id)
                continue
            except TransportError as exc:
                events.append(failed(request_id=request_id, reason=f"{type(exc).__name__}: {exc}"))
                continue
            if state == "DONE":
                self.counters[f"{op.lower()}s_done"] += 1
                nbytes = getattr(handle, "nbytes", None)
                if nbytes is None:
                    layout = self.layouts.get(engine, {})
                    nbytes = handle.num_blocks * layout.get("block_size", 0) * len(layout.get("base_addrs", ()))
                self.counters["bytes_moved"] += nbytes
                events.append(done(request_id=request_id))
        return events


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
    A.RefuseForeignSender: PlaneDriver._refused,
    A.RefuseWrongCount: PlaneDriver._refused,
}


def introduce(*drivers: "PlaneDriver") -> None:
    """Make every pair of ``drivers`` trust each other (tests, one-host jobs)."""
    for a in drivers:
        for b in drivers:
            if a is not b:
                a.trust_peer(b.engine_id, b.public_key)
