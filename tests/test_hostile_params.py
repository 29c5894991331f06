"""Hostile kv_transfer_params through the whole vLLM-facing path (issue 30):
D's scheduler half, then its worker half reading from a real P (real NIXL
and ZMQ over loopback, a real 32-block pool), as vLLM would drive them.

Whatever the params (mutations of P's signed params, random junk), no
untyped exception escapes, each recv is either refused up front or
reported (done or failed), and at the end neither side holds anything.
Two deployments: one with a secret (P signs, D verifies) and one
``kvplane_insecure`` (unauthenticated params reach the worker, where a
block id past P's pool used to kill D's EngineCore)."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvplane.connector.kv_dump import DUMP_KEY
from kvplane.connector.param_auth import AUTH_KEY, SIGNED
from kvplane.connector.vllm_scheduler import VllmSchedulerSide
from kvplane.connector.vllm_settings import settings_from
from kvplane.connector.vllm_worker import VllmWorkerSide
from kvplane.transport.wire import encode_completion, encode_heartbeats
from vllm_support import Req as VllmRequest
from vllm_support import deployment_secret, run_until

BLOCKS, BLOCK_TOKENS, WIDTH, TOKENS = 32, 16, 8, 40
P_BLOCKS, D_BLOCKS = (3, 4, 5), (10, 11, 12)
# Short leases and handshakes: what a hostile example leaves on P ends soon,
# and a connection the params misdirect fails fast.
FAST = {"kv_lease_duration": 6, "handshake_timeout": 1.0, "handshake_max_attempts": 1}


def Req(request_id: str, params, **kw) -> VllmRequest:
    return VllmRequest(request_id, params, **{"num_prompt_tokens": TOKENS, "num_computed_tokens": TOKENS, **kw})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, name: str, seed: int, **extra):
        self.settings = settings_from({**FAST, **extra}, side_channel_port=free_port(), environ={})
        self.sched = VllmSchedulerSide(name, self.settings, block_size=BLOCK_TOKENS)
        self.worker = VllmWorkerSide(name, self.settings)
        g = torch.Generator().manual_seed(seed)
        self.kv = {f"layer{i}": torch.randn(BLOCKS, 2, BLOCK_TOKENS, WIDTH, generator=g).to(torch.bfloat16)
                   for i in range(2)}
        self.worker.register_kv_caches(self.kv)
        self.sched.add_ranks({0: self.worker.rank_info()})
        self.recving: set[str] = set()
        self.failed: set[str] = set()

    def step(self, scheduled=()) -> None:
        self.worker.bind(self.sched.build_step(list(scheduled)))
        _, recving, failed, _ = self.worker.results()
        self.recving |= recving
        self.failed |= failed
        report = self.worker.take_report()
        self.sched.update_from_workers([report] if report else [])

    @property
    def driver(self):
        return self.worker.driver


class Deployment:
    def __init__(self, tmp, secure: bool):
        extra = {"kvplane_secret_file": deployment_secret(tmp)} if secure else {"kvplane_insecure": True}
        self.p = Engine("prefill-0", 1, **extra)
        self.d = Engine("decode-0", 2, **extra)
        self.ids = itertools.count()
        self.outcomes = {"refused": 0, "local": 0, "done": 0, "failed": 0}

    def grant(self) -> tuple[str, dict]:
        i = next(self.ids)
        x = Req(f"x{i}", {"do_remote_decode": True})
        self.p.sched.on_new_request(x)
        delay, params = self.p.sched.request_finished(x, P_BLOCKS)
        assert delay and params is not None
        self.p.step()
        return f"a{i}", params

    def decode(self, rid: str, params, **req) -> str:
        """D's side of one request, as vLLM drives it; the outcome."""
        p, d = self.p, self.d
        a = Req(rid, params, num_computed_tokens=0, **req)
        d.sched.on_new_request(a)
        n, load_async = d.sched.get_num_new_matched_tokens(a, 0)
        if n == 0:
            assert not load_async and d.sched.sched.request(rid) is None  # refused: no machine
            d.sched.update_state_after_alloc(a, D_BLOCKS, 0)
            a.num_computed_tokens = TOKENS
            assert d.sched.request_finished(a, D_BLOCKS)[1] is None
            d.step()
            # Params that ask no remote prefill make a local request: nothing refused.
            outcome = "refused" if isinstance(params, dict) and params.get("do_remote_prefill") else "local"
        else:
            assert (n, load_async) == (TOKENS, True)
            d.sched.update_state_after_alloc(a, D_BLOCKS, n)
            run_until(lambda: rid in d.recving, p, d)
            outcome = "failed" if rid in d.failed else "done"
            d.step([rid])
            a.num_computed_tokens = TOKENS
            assert d.sched.request_finished(a, D_BLOCKS) == (False, None)
            d.step()
        self.outcomes[outcome] += 1
        return outcome

    def wind_down(self) -> None:
        """Every lease expires or is consumed; idle engines are closed; then
        neither side may hold anything."""
        p, d = self.p, self.d
        run_until(lambda: not p.driver.plane.held() and not p.driver.plane.instances["lease"], p, d,
                  timeout=3 * p.settings.plane.kv_lease_duration)
        for e in (p, d):
            with e.worker.lock:
                e.driver.disconnect_idle_engines("test over")
            e.step()
        run_until(lambda: not d.driver.plane.held() and not p.driver.plane.held(), p, d, timeout=10)
        assert p.worker.ticker.errors == d.worker.ticker.errors == 0

    def close(self) -> None:
        for e in (self.p, self.d):
            e.worker.shutdown()


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    made = {"secure": Deployment(tmp_path_factory.mktemp("secure"), secure=True),
            "insecure": Deployment(tmp_path_factory.mktemp("insecure"), secure=False)}
    yield made
    for dep in made.values():
        dep.close()


# ---------------------------------------------------------------- hostile params
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
KEYS = list(SIGNED) + [AUTH_KEY, "do_remote_prefill", "do_remote_decode", "remote_blocks_expiry_time", "dcp_size",
                       "pp_size", "push", DUMP_KEY, "remote_expiry"]
BLOCK_IDS = st.sampled_from([0, 1, 5, 31, 32, 33, 1000, 2 ** 31, 2 ** 32 - 1]) | st.integers(0, 2 ** 32 - 1)
MUTATION = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), JSONISH),
    st.tuples(st.just("drop"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("blocks"), st.none(), st.lists(BLOCK_IDS, min_size=3, max_size=3) | st.lists(BLOCK_IDS)),
    # Weighted up: the block list is what reaches the worker half when
    # params are unauthenticated.
    st.tuples(st.just("blocks"), st.none(), st.lists(BLOCK_IDS, min_size=3, max_size=3)),
    st.tuples(st.just("auth"), st.sampled_from(["kid", "prompt_sha256", "issued", "mac", "v"]), JSONISH),
    st.tuples(st.just("junk"), st.none(), st.dictionaries(st.text(max_size=10), JSONISH, max_size=6)),
)
PROMPT = st.none() | st.lists(st.integers(0, 50_000), min_size=TOKENS, max_size=TOKENS)


# Where a mutated address points instead (tests target loopback only): a
# loopback address nothing listens on.
NOWHERE_HOST, NOWHERE_PORT = "127.0.0.3", 9


def _loopback_only(out: dict, params: dict) -> dict:
    """A mutated host or port that D might connect to becomes one that goes
    nowhere (a hostname would mean a DNS query, a local port someone's
    service); what is malformed stays malformed."""
    if isinstance(out.get("remote_host"), str) and out["remote_host"] != params["remote_host"]:
        out["remote_host"] = NOWHERE_HOST
    if isinstance(out.get("remote_port"), int) and out["remote_port"] != params["remote_port"]:
        out["remote_port"] = NOWHERE_PORT
    ports = out.get("remote_rank_ports")
    if isinstance(ports, list) and ports != params["remote_rank_ports"]:
        out["remote_rank_ports"] = [NOWHERE_PORT if isinstance(q, int) and not isinstance(q, bool) else q
                                    for q in ports]
    return out


def mutate(params: dict, mutations) -> dict:
    out = copy.deepcopy(params)
    for kind, key, value in mutations:
        if kind == "set":
            out[key] = value
        elif kind == "drop":
            out.pop(key, None)
        elif kind == "blocks":
            out["remote_block_ids"] = [value]  # vLLM's shape: one list per KV cache group
        elif kind == "auth" and isinstance(out.get(AUTH_KEY), dict):
            out[AUTH_KEY][key] = value
        elif kind == "junk":
            out = dict(value, do_remote_prefill=True)
    return _loopback_only(out, params)


@pytest.mark.parametrize("mode", ["secure", "insecure"])
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutations=st.lists(MUTATION, max_size=3), prompt=PROMPT, flip=st.booleans())
@example(mutations=[], prompt=None, flip=False)
@example(mutations=[("blocks", None, [1, 2, 32])], prompt=None, flip=False)
@example(mutations=[("blocks", None, [0, 2 ** 32 - 1, 7])], prompt=None, flip=False)
def test_hostile_params_never_crash_leak_or_load_unchecked(deployments, mode, mutations, prompt, flip):
    dep = deployments[mode]
    rid, params = dep.grant()
    hostile = mutate(params, mutations)
    kw = {} if prompt is None else {"prompt_token_ids": prompt}
    outcome = dep.decode(rid, hostile, **kw)
    changed = hostile != params or prompt is not None
    if mode == "secure" and changed and outcome == "done":
        # Only changes the MAC does not cover may still load: keys D never reads.
        ignored = {k for k in set(hostile) | set(params) if hostile.get(k) != params.get(k)}
        assert prompt is None and not ignored & (set(SIGNED) | {AUTH_KEY}), (mutations, ignored)
    if not changed:
        assert outcome == "done"
    if flip:  # the same params once more: a replay (secure: refused up front)
        again = dep.decode(f"{rid}-again", hostile, **kw)
        if mode == "secure":
            assert again == ("refused" if hostile.get("do_remote_prefill") else "local")


def test_zz_both_sides_end_holding_nothing(deployments):
    """After every hostile example: the outcomes were of every kind, and
    once P's leases ran out, neither side holds anything."""
    secure, insecure = deployments["secure"], deployments["insecure"]
    assert secure.outcomes["refused"] > 0 and secure.outcomes["done"] > 0
    assert insecure.outcomes["failed"] > 0 and insecure.outcomes["done"] > 0
    refused = secure.d.sched.stats().get("kvplane_refused_params", 0)
    assert refused == secure.outcomes["refused"]  # every refusal counted, once
    for dep in (secure, insecure):
        dep.wind_down()


# ---------------------------------------------------------------- the known paths, one by one
def test_a_block_id_past_ps_pool_fails_the_recv_and_d_stays_up(tmp_path):
    """The finding that killed D's EngineCore: insecure params with a valid
    u32 block id not below P's block count."""
    dep = Deployment(tmp_path, secure=False)
    try:
        rid, params = dep.grant()
        assert dep.decode(rid, dict(params, remote_block_ids=[[3, 4, BLOCKS]])) == "failed"
        assert dep.d.driver.counters["reads_refused"] == 1
        counts, _ = dep.d.worker.stats()
        assert counts["num_failed_transfers"] == 1 and counts["kvplane_failed_recvs"] == 1
        rid, params = dep.grant()
        assert dep.decode(rid, params) == "done"  # D goes on serving
        dep.wind_down()
    finally:
        dep.close()


def test_an_ended_lease_binds_no_new_reader(tmp_path):
    """After D consumed P's lease, its name is dead on P: a replayed
    completion or heartbeat naming it creates or extends nothing, and D
    refuses the same params again before it reads anything."""
    dep = Deployment(tmp_path, secure=True)
    p, d = dep.p, dep.d
    try:
        rid, params = dep.grant()
        assert dep.decode(rid, params) == "done"
        run_until(lambda: not p.driver.plane.instances["lease"], p, d)
        name = params["remote_request_id"]
        before = dict(p.driver.counters)
        # D's agent sends what a replaying reader would: a completion and a heartbeat.
        agent = d.driver.agents[f"{p.driver.engine_id}"]
        with d.worker.lock:
            d.driver.endpoint.send_notif(agent, encode_completion(name, 1))
            for msg in encode_heartbeats([name]):
                d.driver.endpoint.send_notif(agent, msg)
        run_until(lambda: p.driver.counters["heartbeats_received"] > before.get("heartbeats_received", 0), p, d)
        run_until(lambda: p.driver.counters["notifs_unknown_lease"] >= before.get("notifs_unknown_lease", 0) + 2,
                  p, d)
        assert not p.driver.plane.instances["lease"] and not p.driver.plane.held()
        with p.worker.lock:
            assert p.driver.plane.get("lease", "x0") is None
            # The completion waits in the early buffer (a few seconds) for a
            # grant that never comes: no lease x0, so the dead name stays dead.
            assert not p.driver.adopt_lease_name("x0", name)
        assert dep.decode(f"{rid}-replay", params) == "refused"
        dep.wind_down()
    finally:
        dep.close()


def test_a_request_whose_set_up_raises_fails_alone(tmp_path, monkeypatch):
    """The worker half's last line: an unforeseen exception setting up one
    request's recv fails that recv (vLLM recomputes it); the engine and the
    other requests go on."""
    dep = Deployment(tmp_path, secure=True)
    try:
        real = dep.d.worker.worker._new_request
        calls = []

        def once(rid, rk, push):
            calls.append(rid)
            if len(calls) == 1:
                raise RuntimeError("unforeseen")
            return real(rid, rk, push)

        monkeypatch.setattr(dep.d.worker.worker, "_new_request", once)
        rid, params = dep.grant()
        assert dep.decode(rid, params) == "failed"
        assert dep.d.worker.worker.counters["new_request_errors"] == 1
        rid, params = dep.grant()
        assert dep.decode(rid, params) == "done"
        dep.wind_down()
    finally:
        dep.close()


def test_side_channel_and_rotation_with_real_engines(tmp_path):
    """CURVE from the secret: a holder of the deployment key fetches P's
    metadata, a stranger's key or plaintext gets nothing.  Rotation, step 2
    (P signs with NEW and accepts OLD, D the other way round): D reads from
    P, and a D that knows only OLD refuses P's params before connecting."""
    from kvplane.connector.secret import keys_from_text
    from kvplane.transport.handshake import HandshakeError, handshake

    old, new = "o" * 64, "n" * 64
    for name, text in (("p", f"{new}\n{old}\n"), ("d", f"{old}\n{new}\n"), ("d_old", old)):
        (tmp_path / name).write_text(text)
    p = Engine("prefill-0", 1, kvplane_secret_file=str(tmp_path / "p"))
    d = Engine("decode-0", 2, kvplane_secret_file=str(tmp_path / "d"))
    d_old = Engine("decode-1", 3, kvplane_secret_file=str(tmp_path / "d_old"))
    try:
        url, server_key = p.driver.side_channel_url, keys_from_text(new).signing.curve_public
        for member in (new, old):
            got = handshake(url, p.driver.engine_id, p.driver.compat_hash, 5.0, server_public_key=server_key,
                            client_keypair=keys_from_text(member).signing.curve_keypair)
            assert got.metadata
        for stranger in ({"client_keypair": keys_from_text("s" * 64).signing.curve_keypair,
                          "server_public_key": server_key}, {"insecure": True}):
            with pytest.raises(HandshakeError):
                handshake(url, p.driver.engine_id, p.driver.compat_hash, 1.0, **stranger)

        dep = Deployment.__new__(Deployment)
        dep.p, dep.d, dep.ids, dep.outcomes = p, d, itertools.count(), {"refused": 0, "local": 0, "done": 0, "failed": 0}
        rid, params = dep.grant()
        assert dep.decode(rid, params) == "done"
        for name in p.kv:
            assert torch.equal(d.kv[name][list(D_BLOCKS)], p.kv[name][list(P_BLOCKS)])
        dep.d = d_old
        rid, params = dep.grant()
        assert dep.decode(rid, params) == "refused"
        assert d_old.sched.counters["refused_params: unknown key"] == 1
        assert d_old.driver.counters["handshakes_started"] == 0  # refused before connecting anywhere
        dep.d = d
        dep.wind_down()
    finally:
        for e in (p, d, d_old):
            e.worker.shutdown()
