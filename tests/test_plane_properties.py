"""Random stimuli (garbage ids included) and time advances over a ControlPlane,
with the plane's invariants checked after every step."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvplane.statemachines import events as E
from kvplane.statemachines.actions import PostWrite, ReleaseXfer, ReportRecv
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.machines.push_write import SOURCE
from kvplane.statemachines.plane import ControlPlane

REQ = st.sampled_from(["r1", "r2", "r3", "ghost"])
ENG = st.sampled_from(["e1", "e2", "nope"])
PEER = st.sampled_from(["x1", "x2", "x3"])
# Numbers from the wire or the embedder, NaN and infinities included.
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
CFG = PlaneConfig(kv_lease_duration=6.0, engine_ttl=4.0, handshake_timeout=2.0, transfer_timeout=3.0,
                  recv_timeout=8.0, push_registration_timeout=3.0, decoder_kv_blocks_ttl=10.0)


class PlaneMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.plane = ControlPlane(CFG)
        self.now = 0.0
        self.reported: set = set()

    def _feed(self, event):
        self._step(lambda: self.plane.handle(event, self.now))

    def _step(self, fn):
        p = self.plane
        states = p.machines["decode_request"].states
        awaiting = {k for k, i in p.instances["decode_request"].items() if "report" in states[i.state].holds}
        out = fn()  # never raises: any exception fails the test
        for n, a in enumerate(out):
            if isinstance(a, PostWrite):
                # From blocks the lease still holds, or cancelled in the same step.
                lease = p.instances["lease"].get(a.request_id)
                assert (lease is not None and lease.state in SOURCE.held) or \
                    ReleaseXfer(a.request_id, True) in out[n:], f"WRITE {a.request_id} from an unheld lease"
        for a in out:
            if isinstance(a, ReportRecv):
                assert a.request_id in awaiting, f"ReportRecv for {a.request_id}, which was not awaited"
                assert a.request_id not in self.reported, f"ReportRecv for {a.request_id} twice"
                self.reported.add(a.request_id)
                inst = p.instances["decode_request"].get(a.request_id)
                assert inst is None or "report" not in states[inst.state].holds
        # A request that awaits again (a new incarnation) may be reported again.
        self.reported -= {k for k, i in p.instances["decode_request"].items() if "report" in states[i.state].holds}

    @rule(r=REQ, e=ENG, peer=PEER, push=st.booleans(), expiry=st.none() | st.floats(0, 30) | NON_FINITE)
    def new_request(self, r, e, peer, push, expiry):
        self._feed(E.NewRequest(request_id=r, engine_id=e, remote_request_id=peer, remote_block_ids=(1,),
                                push=push, remote_expiry=expiry))

    @rule(r=REQ, tokens=st.sampled_from([0, 4]), awaiting=st.booleans())
    def allocated(self, r, tokens, awaiting):
        self._feed(E.BlocksAllocated(request_id=r, block_ids=(2,), num_remote_tokens=tokens, awaiting=awaiting))

    @rule(r=REQ, which=st.sampled_from(["StartLoad", "ReadDone", "ReadFailed", "PushDone", "RequestRunning", "Abort"]))
    def request_event(self, r, which):
        self._feed(getattr(E, which)(request_id=r))

    @rule(r=REQ, hold=st.booleans())
    def finished(self, r, hold):
        self._feed(E.RequestFinished(request_id=r, block_ids=(2,), hold_for_next_turn=hold))

    @rule(e=ENG, offset=st.floats(-5, 5) | NON_FINITE, notify=st.booleans())
    def handshake_ok(self, e, offset, notify):
        self._feed(E.HandshakeOk(engine_id=e, samples=((offset, 0.01),), notify_only=notify))

    @rule(e=ENG, which=st.sampled_from(["HandshakeFailed", "EngineActivity", "PeerDisconnected"]))
    def engine_event(self, e, which):
        self._feed(getattr(E, which)(engine_id=e))

    @rule(p=PEER, n=st.integers(1, 2), duration=st.none() | st.floats(0, 20) | NON_FINITE)
    def lease_granted(self, p, n, duration):
        self._feed(E.LeaseGranted(request_id=p, block_ids=(3,), expected_consumers=n, duration=duration))

    @rule(p=PEER, which=st.sampled_from(["LeaseHeartbeat", "LeaseAbort"]))
    def lease_event(self, p, which):
        self._feed(getattr(E, which)(request_id=p))

    @rule(p=PEER, consumer=st.sampled_from(["c1", "c2"]), n=st.integers(1, 2))
    def consumer_done(self, p, consumer, n):
        self._feed(E.ConsumerDone(request_id=p, consumer=consumer, expected_consumers=n))

    @rule(p=PEER, e=ENG, which=st.sampled_from(["reg", "ready", "WriteDone", "WriteFailed", "PushAbort"]),
          deadline=st.none() | st.floats(0, 40) | NON_FINITE)
    def push_event(self, p, e, which, deadline):
        if which == "reg":
            ev = E.PushRegistered(request_id=p, engine_id=e, remote_request_id="d-" + p, remote_block_ids=(1,),
                                  remote_deadline=deadline)
        elif which == "ready":
            ev = E.PushReady(request_id=p, block_ids=(3,))
        else:
            ev = getattr(E, which)(request_id=p)
        self._feed(ev)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0, 30.0]))
    def advance(self, dt):
        self.now += dt
        self._step(lambda: self.plane.fire_due(self.now))

    @rule()
    def to_next_deadline(self):
        nd = self.plane.next_deadline()
        if nd is not None:
            self.now = max(self.now, nd)
            self._step(lambda: self.plane.fire_due(self.now))

    # ------------------------------------------------------------ invariants
    @invariant()
    def held_matches_states(self):
        p = self.plane
        expected = set()
        for kind, insts in p.instances.items():
            states = p.machines[kind].states
            for key, inst in insts.items():
                if states[inst.state].holds:
                    expected.add((kind, key, inst.state, tuple(sorted(states[inst.state].holds))))
        assert set(p.held()) == expected

    @invariant()
    def a_push_has_blocks_only_while_its_lease_holds_them(self):
        p = self.plane
        for key, push in p.instances["push_write"].items():
            if push.state in SOURCE.needs:
                lease = p.instances["lease"].get(key)
                assert lease is not None and lease.state in SOURCE.held, f"push {key} in {push.state} outlives its lease"

    @invariant()
    def deadlines_are_finite(self):
        import math

        for at, _, _, _ in self.plane.timer_entries():
            assert math.isfinite(at)

    @invariant()
    def no_live_terminal_instance(self):
        p = self.plane
        for kind, insts in p.instances.items():
            for key, inst in insts.items():
                assert not p.machines[kind].is_terminal(inst), f"{kind}:{key} kept in {inst.state}"

    @invariant()
    def every_deadline_has_a_live_timer(self):
        p = self.plane
        armed = {(kind, key, at) for at, _, kind, key in p.timer_entries()}
        for kind, insts in p.instances.items():
            states = p.machines[kind].states
            for key, inst in insts.items():
                if states[inst.state].deadline is not None:
                    assert inst.deadline is not None, f"{kind}:{key} in {inst.state} has no deadline"
                    # Its one live entry comes due at the deadline or before it (then re-arms at it).
                    at = inst.timer_at
                    assert at is not None and (kind, key, at) in armed, f"{kind}:{key} deadline {inst.deadline} not armed"
                    assert at <= inst.deadline, f"{kind}:{key} armed at {at}, after its deadline {inst.deadline}"


PlaneMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestPlaneProperties = PlaneMachine.TestCase
