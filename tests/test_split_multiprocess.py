"""The split as an engine runs it: the scheduler-side connectors in this
process, every worker rank its own process with its own NIXL agent, KV
shard and side channel (real NIXL over UCX loopback, real ZMQ with CURVE).
Nothing is shared but the pickled records over the pipes."""
from __future__ import annotations

import time

import pytest
import zmq

from kvplane.app.ranks.group import RankGroup
from kvplane.app.ranks.messages import Fill, RankOptions, Verify
from kvplane.connector.scheduler import ConnectorScheduler
from kvplane.statemachines.config import PlaneConfig

FIELDS = dict(kv_lease_duration=6.0, transfer_timeout=5.0, recv_timeout=20.0, handshake_timeout=10.0)
BLOCK_ELEMS = 4096
NUM_BLOCKS = 16


class Engine:
    def __init__(self, name: str, tp: int, keys, peers):
        self.sched = ConnectorScheduler(name, tp_size=tp, config=PlaneConfig(**FIELDS))
        self.verified: dict[int, dict[int, bool]] = {}
        self.lease_events: list = []
        self.sending, self.recving, self.failed = set(), set(), set()
        self.reasons: dict[str, str] = {}  # why each failed recv failed

        def options(rank: int) -> RankOptions:
            return RankOptions(engine_id=name, rank=rank, tp_size=tp, plane_fields=FIELDS, num_blocks=NUM_BLOCKS,
                               block_elems=BLOCK_ELEMS, keypair=keys, peers=peers)

        self.group = RankGroup(self.sched, options,
                               on_verified=lambda r, token, ok: self.verified.setdefault(token, {}).__setitem__(r, ok),
                               on_lease_event=lambda r, rid, what, t, expiry: self.lease_events.append((r, rid, what)))

    def step(self) -> None:
        self.group.step()
        report = self.sched.get_finished()
        self.sending |= set(report.finished_sending)
        self.recving |= set(report.finished_recving)
        self.failed |= set(report.failed_ids)
        self.reasons.update((f.request_id, f.reason) for f in report.failed_recving)

def run_until(engines, until, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for e in engines:
            e.step()
        if until():
            return True
        time.sleep(0.001)
    return False

@pytest.fixture
def engines(request):
    p_tp, d_tp = request.param
    pk, dk = zmq.curve_keypair(), zmq.curve_keypair()
    p = Engine("P", p_tp, pk, {"D": dk[0]})
    d = Engine("D", d_tp, dk, {"P": pk[0]})
    yield p, d
    for e in (p, d):
        e.group.kill()

def prefill_and_pull(p: Engine, d: Engine, blocks=(1, 2, 3), local=(7, 8, 9)):
    p.group.send_all(Fill("req", blocks, 0))
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    _, params = p.sched.request_finished("r1", blocks, reader_tp=d.sched.tp_size)
    d.sched.on_new_request("d1", params)
    n, _ = d.sched.get_num_new_matched_tokens("d1", 16 * len(blocks), 0)
    d.sched.update_state_after_alloc("d1", local, n)

@pytest.mark.parametrize("engines", [(2, 2)], indirect=True, ids=["P2-D2"])
def test_ranks_in_their_own_processes_move_and_verify_every_head(engines):
    p, d = engines
    prefill_and_pull(p, d)
    assert run_until((p, d), lambda: "d1" in d.recving and "r1" in p.sending, 60)
    d.group.send_all(Verify(1, "req", (7, 8, 9), 0))
    assert run_until((p, d), lambda: len(d.verified.get(1, {})) == d.sched.tp_size, 30)
    assert d.verified[1] == {r: True for r in range(d.sched.tp_size)}
    d.sched.request_running("d1")
    d.sched.request_finished("d1", (7, 8, 9))
    d.step()
    p_sum, d_sum = p.group.stop(), d.group.stop()
    for s in [*p_sum.values(), *d_sum.values()]:
        assert s.plane_held == [] and s.held_lease_blocks == 0, s.engine_id
    assert all(s.leases_ended == {"consumed": 1} for s in p_sum.values())
    assert sum(s.bytes_moved for s in d_sum.values()) == 3 * BLOCK_ELEMS * 4
    assert {r for r, _rid, what in p.lease_events if what == "consumed"} == set(range(p.sched.tp_size))

@pytest.mark.parametrize("engines", [(2, 2)], indirect=True, ids=["P2-D2"])
def test_a_killed_decode_rank_fails_the_request_and_p_frees_on_every_rank(engines):
    p, d = engines
    d.group.procs[1].kill()
    d.group.procs[1].join(10)
    prefill_and_pull(p, d)
    assert run_until((p, d), lambda: "d1" in d.failed and "r1" in p.sending, 60)
    assert "rank 1 lost" in d.reasons["d1"]
    assert d.group.lost == {1}
    p_sum = p.group.stop()
    assert p_sum[0].leases_ended == {"consumed": 1}
    assert p_sum[1].leases_ended == {"expired": 1}  # its reader died: the lease ran out
    assert all(s.held_lease_blocks == 0 and s.plane_held == [] for s in p_sum.values())
