"""A dead or hung prefill engine must not hurt requests for other engines.

Real ZMQ side channels on 127.0.0.1 and the wall clock; the KV moves over
the loopback fabric.  The dead and hung engines are legitimate ones (trusted
keys, params they granted themselves): authentication cannot keep them out.
A hung engine's process still holds its port (the kernel accepts the TCP
connection) but never answers; a dead one's port is closed.
"""
from __future__ import annotations

import time

import pytest
import torch

from loopback_support import ELEMS, Side

from kvplane.connector.driver import introduce
from kvplane.statemachines.config import PlaneConfig
from kvplane.transport.loopback import LoopbackFabric

# Policy "fail": a failed recv is named by request id (get_failed_requests).
CFG = PlaneConfig(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=20.0, handshake_timeout=3.0,
                  handshake_backoff=0.5, handshake_max_attempts=3, kv_load_failure_policy="fail")
HUNG, DEAD = 5, 2  # more silent engines than the old pool's 4 workers


def _grant(p: Side, rid: str, blocks=(1, 2, 3)) -> dict:
    """P computes ``rid`` and hands out the params for it."""
    p.kv[list(blocks)] = torch.rand(len(blocks), ELEMS)
    p.sched.on_new_request(rid, {"do_remote_decode": True})
    _, params = p.sched.request_finished(rid, blocks)
    return params


def _ask(d: Side, rid: str, params: dict, local=(5, 6, 7)) -> None:
    """D gets a request with ``params`` and allocates its blocks."""
    d.sched.on_new_request(rid, params)
    n, _ = d.sched.get_num_new_matched_tokens(rid, 16 * len(local), 0)
    assert n == 16 * len(local)
    d.sched.update_state_after_alloc(rid, local, n)


class Recorder:
    """D's finished recvs, when each was reported, and which failed."""

    def __init__(self, d: Side):
        self.d, self.at, self.failed = d, {}, set()

    def step(self) -> None:
        self.d.step()
        now = time.monotonic()
        for rid in self.d.recving - self.at.keys():
            self.at[rid] = now
        self.failed |= self.d.worker.get_failed_requests()


@pytest.fixture
def engines():
    fabric = LoopbackFabric()
    sides = {name: Side(fabric, name, time.monotonic, CFG)
             for name in ["D", "P_ok"] + [f"P_hung{i}" for i in range(HUNG)] + [f"P_dead{i}" for i in range(DEAD)]}
    introduce(*(s.driver for s in sides.values()))
    yield sides
    for s in sides.values():
        s.worker.shutdown()


def test_silent_engines_neither_delay_a_healthy_one_nor_hold_their_requests(engines):
    d, ok = engines["D"], engines["P_ok"]
    silent = [s for name, s in engines.items() if name.startswith(("P_hung", "P_dead"))]
    # Every silent engine grants its leases while alive; then the dead ones
    # close their side channel, the hung ones stop answering (never stepped).
    params = {s.driver.engine_id: [_grant(s, f"{s.driver.engine_id}-r{k}") for k in range(8)] for s in silent}
    for s in silent:
        if s.driver.engine_id.startswith("P_dead"):
            s.driver.server.close()
    rec = Recorder(d)
    asked: dict[str, float] = {}

    def ask(rid, prm):
        _ask(d, rid, prm)
        asked[rid] = time.monotonic()

    def pump(seconds: float, flood_round: int | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rec.step()
            ok.step()
            time.sleep(0.005)

    # A flood: every silent engine named by a request, then more while they hang.
    for engine, prms in params.items():
        ask(f"{engine}-d0", prms[0])
    pump(0.3)
    assert len(d.driver.handshaker.in_flight()) == HUNG + DEAD  # every silent engine has its attempt running
    healthy = _grant(ok, "ok-r1")
    ask("ok-d1", healthy)
    for k in range(1, 4):
        for engine, prms in params.items():
            ask(f"{engine}-d{k}", prms[k])
        pump(0.2)
    deadline = time.monotonic() + 3 * CFG.handshake_timeout
    while "ok-d1" not in rec.at and time.monotonic() < deadline:
        pump(0.05)

    # The healthy engine's request: read, correct, and never queued behind the
    # silent engines' attempts.  Its own handshake takes milliseconds; behind
    # them it would wait until the first of them times out (2.7 s here, with
    # the old pool of 4 threads).
    assert "ok-d1" in rec.at and "ok-d1" not in rec.failed
    assert rec.at["ok-d1"] - asked["ok-d1"] < CFG.handshake_timeout / 2
    assert torch.equal(d.kv[5:8], ok.kv[1:4])

    # Requests for a silent engine fail (recompute), each after at most one
    # handshake timeout; those that came during the backoff at once.
    pump(CFG.handshake_timeout + 0.5)
    silent_rids = [rid for rid in asked if rid != "ok-d1"]
    assert set(silent_rids) <= rec.failed
    slack = 0.5  # steps and scheduling on a busy machine
    for rid in silent_rids:
        assert rec.at[rid] - asked[rid] < CFG.handshake_timeout + slack, rid
    for engine in params:
        e = d.driver.plane.get("remote_engine", engine)
        assert e is not None and e.state == "HANDSHAKE_FAILED"
        # One attempt per engine so far, however many requests named it: the
        # later requests came during the attempt or its backoff.
        assert e.attempts == 1, engine
    assert d.driver.counters["handshakes_started"] == HUNG + DEAD + 1

    # After the backoff a new request tries again: one attempt, backed off twice as long.
    time.sleep(CFG.handshake_backoff)
    engine = "P_hung0"
    ask(f"{engine}-d4", params[engine][4])
    pump(0.1)
    e = d.driver.plane.get("remote_engine", engine)
    assert e.state == "HANDSHAKING" and e.attempts == 2
    pump(CFG.handshake_timeout + 0.3)
    assert e.state == "HANDSHAKE_FAILED" and f"{engine}-d4" in rec.failed
    assert e.retry_at - rec.at[f"{engine}-d4"] == pytest.approx(2 * CFG.handshake_backoff, abs=0.3)

    held = [h for h in d.driver.plane.held() if h[0] != "remote_engine"]
    assert held == [] and d.driver.xfers == {}


def test_a_second_attempt_for_an_engine_never_runs_beside_the_first(engines):
    """The machine's attempt timer may fire before the attempt's thread gives
    up; the retry it allows must not open a second connection to that engine."""
    d = engines["D"]
    hung = engines["P_hung0"]
    hs = d.driver.handshaker
    url = hung.driver.side_channel_url
    hs.submit("P_hung0", url, server_public_key=hung.driver.public_key)
    hs.submit("P_hung0", url, server_public_key=hung.driver.public_key)
    assert hs.in_flight() == {"P_hung0": url} and hs.counters["handshakes_coalesced"] == 1
    # Another address waits for the first attempt to end, then runs alone.
    other = engines["P_hung1"].driver.side_channel_url
    hs.submit("P_hung0", other, server_public_key=hung.driver.public_key)
    assert hs.in_flight() == {"P_hung0": url}
    deadline = time.monotonic() + 3 * CFG.handshake_timeout
    outcomes = []
    while len(outcomes) < 2 and time.monotonic() < deadline:
        outcomes += hs.completed()
        if len(outcomes) == 1:
            assert hs.in_flight() == {"P_hung0": other}
        time.sleep(0.01)
    assert [o.url for o in outcomes] == [url, other] and all(o.error is not None for o in outcomes)
    assert hs.in_flight() == {}


def test_past_its_capacity_the_pool_fails_a_new_engine_at_once(engines):
    """Every admitted attempt has its own thread; one more engine than that
    is failed at once (its machine backs off), never queued."""
    from kvplane.connector.handshaker import Handshaker, HandshakeBusy

    hs = Handshaker("kvplane-v1", CFG.handshake_timeout, max_in_flight=2, insecure=True)
    try:
        for name in ("P_hung0", "P_hung1", "P_hung2"):
            hs.submit(name, engines[name].driver.side_channel_url)
        (busy,) = hs.completed()
        assert busy.engine_id == "P_hung2" and isinstance(busy.error, HandshakeBusy)
        assert set(hs.in_flight()) == {"P_hung0", "P_hung1"} and hs.counters["handshakes_refused_busy"] == 1
    finally:
        hs.close()
