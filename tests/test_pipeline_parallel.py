"""Pipeline parallel on the prefill side (NixlConnector 0.32.0's PP: P with
PP > 1, D with PP 1): each P stage holds a slice of the layers on its own
ranks, says which in its handshake, and D reads each layer from the stage
that holds it.  The layer slice and region pairing (pure), then P PP 2
(x TP 1 or 2) -> D over the split connector on the loopback transport."""
from __future__ import annotations

import pickle

import attrs
import pytest
import torch
import zmq

from loopback_support import Clock, run
from split_support import HEADS, HEAD_ELEMS, block_value, rank_slice, shutdown_all, through_the_wire

from kvplane.connector.params import BadTransferParams, RemoteKV
from kvplane.connector.rank_factory import RankSetup, build_rank
from kvplane.connector.scheduler import ConnectorScheduler
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.tp_mapping import Part, Source, TpMapping
from kvplane.transport.descriptors import plan_transfer
from kvplane.transport.errors import IncompatibleLayout
from kvplane.transport.layer_slice import LAYER_SLICE, LayerSlice, local_first_region
from kvplane.transport.layout import CacheLayout
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

CFG = dict(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)
BLOCKS = 16


# ---------------------------------------------------------------- the mapping (pure)
def test_a_reader_rank_reads_its_heads_from_every_stage_in_stage_order():
    m = TpMapping(2, 1, holder_pp=2)  # P: 2 stages x TP 2 = ranks 0, 1 (stage 0) and 2, 3 (stage 1)
    assert m.holder_ranks == 4
    assert m.sources(0) == (Source(0, local=Part(0, 2)), Source(1, local=Part(1, 2)),
                            Source(2, local=Part(0, 2)), Source(3, local=Part(1, 2)))
    m = TpMapping(1, 2, holder_pp=2)  # P: 2 stages x TP 1; D TP 2: each D rank half of each stage's heads
    assert m.sources(1) == (Source(0, remote=Part(1, 2)), Source(1, remote=Part(1, 2)))
    assert [m.readers_of(h) for h in range(2)] == [(0, 1), (0, 1)]
    assert m.consumers_per_holder_rank == 2  # per P rank, as without PP
    assert TpMapping(2, 1, holder_pp=1).sources(0) == TpMapping(2, 1).sources(0)  # PP 1: unchanged


def test_replicated_kv_leaves_the_same_tp_ranks_of_every_stage_unread():
    assert TpMapping(2, 1, replicated=True, holder_pp=2).unread_holder_ranks == (1, 3)


@pytest.mark.parametrize("value,problem", [
    ([0, 0, 4], "no slice"), ([3, 2, 4], "no slice"), ([0, 1], "first, count, total"), ("0,1,4", "first"),
    ([True, 1, 4], "int"), ([-1, 1, 4], "int"),
])
def test_a_malformed_layer_slice_is_refused_naming_it(value, problem):
    cache = {LAYER_SLICE: value, "base_addrs": [1]}
    with pytest.raises(IncompatibleLayout, match=problem):
        local_first_region(cache, 4)


def test_a_stage_s_regions_pair_with_the_reader_s_layers_it_holds():
    assert local_first_region({"base_addrs": [1, 2]}, 2) is None  # no slice: the whole model
    assert local_first_region({LAYER_SLICE: [1, 2, 3], "base_addrs": [1, 2]}, 3) == 1
    with pytest.raises(IncompatibleLayout, match="3 layer regions"):  # another model's slice
        local_first_region({LAYER_SLICE: [0, 2, 4], "base_addrs": [1, 2]}, 3)
    with pytest.raises(IncompatibleLayout, match="describes 1 regions"):  # says 2 layers, registered 1
        local_first_region({LAYER_SLICE: [0, 2, 4], "base_addrs": [1]}, 4)
    with pytest.raises(IncompatibleLayout, match="whole model"):  # a reader holding a slice itself
        local_first_region({LAYER_SLICE: [0, 2, 4], "base_addrs": [1, 2]}, 4, LayerSlice(0, 2, 4))


def test_a_stage_s_transfer_plan_writes_only_its_layers_regions():
    local = CacheLayout("DRAM", 0, 64, 8, (1 << 20, 2 << 20, 3 << 20))  # D: 3 layers
    remote = CacheLayout("DRAM", 0, 64, 8, (9 << 20, 10 << 20))  # a stage holding layers 1 and 2
    local.check_pairable(remote, 1)
    plan = plan_transfer(local, remote, [4], [2], (0, 1), (0, 1), 64, local_first_region=1)
    assert [(s.region, s.offset) for s in plan.local] == [(1, 4 * 64), (2, 4 * 64)]
    assert [(s.region, s.offset) for s in plan.remote] == [(0, 2 * 64), (1, 2 * 64)]
    with pytest.raises(IncompatibleLayout, match="run past"):
        local.check_pairable(remote, 2)
    with pytest.raises(IncompatibleLayout, match="region count"):
        local.check_pairable(remote)  # unsliced: counts must match


def test_params_name_every_stage_s_ranks():
    base = dict(remote_engine_id="P", remote_host="127.0.0.1", remote_port=5000, remote_request_id="r",
                remote_block_ids=[1], tp_size=2)
    rk = RemoteKV.from_dict(dict(base, pp_size=2))
    assert rk.ranks == 4 and rk.remote_rank_ports == (5000, 5001, 5002, 5003)
    assert RemoteKV.from_dict(dict(base, pp_size=None)).pp_size == 1  # unsigned (absent): one stage
    for bad in (0, True, "2", 1024):
        with pytest.raises(BadTransferParams, match="pp_size"):
            RemoteKV.from_dict(dict(base, pp_size=bad))
    with pytest.raises(BadTransferParams, match=r"tp_size x pp_size \(4\) ports"):
        RemoteKV.from_dict(dict(base, pp_size=2, remote_rank_ports=[5000, 5001]))
    assert RemoteKV.from_dict(rk.to_dict()) == rk


# ---------------------------------------------------------------- P PP x TP -> D over loopback
def layer_value(layer: int, block: int) -> torch.Tensor:
    """Layer ``layer``'s whole block ``block`` on P (every layer different)."""
    return block_value(7, block) + 100_000.0 * layer


class Engine:
    """A serving engine's connector halves, as in split_support, with
    ``pp`` stages of ``tp`` ranks, stage ``s`` holding ``slices[s]`` of the
    model's layers, one region per layer."""

    def __init__(self, fabric, name, clock, tp, keypair, peers, layers: int, pp: int = 1,
                 slices: tuple[LayerSlice, ...] | None = None):
        self.name, self.tp, self.pp = name, tp, pp
        self.slices = slices or (LayerSlice(0, layers, layers),)
        assert len(self.slices) == pp
        self.sched = ConnectorScheduler(name, tp_size=tp, pp_size=pp, config=PlaneConfig(**CFG), clock=clock)
        self.workers, self.kv = [], []  # per rank (stage * tp + tp rank): the worker, its layers' tensors
        for rank in range(tp * pp):
            part = build_rank(RankSetup(engine_id=name, rank=rank, tp_size=tp, pp_size=pp),
                              endpoint_factory=lambda rank_id: LoopbackEndpoint(fabric, rank_id),
                              config=PlaneConfig(**CFG), clock=clock, curve_keypair=keypair, trusted_peers=peers)
            stage_slice = self.slices[rank // tp]
            part.driver.layer_slice = stage_slice
            kv = {f"layer{stage_slice.first + i}": torch.zeros(BLOCKS, HEADS * HEAD_ELEMS // tp)
                  for i in range(stage_slice.count)}
            part.worker.register_kv_caches(kv)
            self.sched.add_rank(through_the_wire(part.worker.rank_info()))
            self.workers.append(part.worker)
            self.kv.append(kv)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()

    def fill(self, blocks) -> None:
        for rank, kv in enumerate(self.kv):
            for name, t in kv.items():
                for b in blocks:
                    t[b] = layer_value(int(name[5:]), b)[rank_slice(self.tp, rank % self.tp)]

    def layer_block(self, layer: int, b: int) -> torch.Tensor:
        """The whole block (every TP rank's heads) of ``layer`` (a PP 1 engine)."""
        return torch.cat([self.kv[r][f"layer{layer}"][b] for r in range(self.tp)])

    def step(self) -> None:
        meta = pickle.dumps(self.sched.build_connector_meta())
        for w in self.workers:
            w.bind(pickle.loads(meta))
            w.step()
            self.sched.update_from_worker(through_the_wire(w.report()))
        report = self.sched.get_finished()
        self.sending |= set(report.finished_sending)
        self.recving |= set(report.finished_recving)
        self.failed |= set(report.failed_ids)

    def held(self) -> list:
        return [h for w in self.workers for h in w.driver.plane.held() if h[0] not in ("remote_engine", "heartbeat")]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def make(clock):
    made: list[Engine] = []

    def build(p_tp: int, d_tp: int, slices: tuple[LayerSlice, ...], d_layers: int | None = None):
        fabric = LoopbackFabric()
        pk, dk = zmq.curve_keypair(), zmq.curve_keypair()
        layers = slices[0].total
        p = Engine(fabric, "P", clock, p_tp, pk, {"D": dk[0]}, layers, pp=len(slices), slices=slices)
        d = Engine(fabric, "D", clock, d_tp, dk, {"P": pk[0]}, d_layers or layers)
        made.extend((p, d))
        return fabric, p, d

    yield build
    for e in made:
        shutdown_all(e.workers)


def pull(p: Engine, d: Engine, blocks=(1, 2, 3), local=(5, 6, 7)) -> dict:
    p.fill(blocks)
    p.sched.on_new_request("r1", {"do_remote_decode": True})
    delay, params = p.sched.request_finished("r1", blocks, reader_tp=d.tp)
    assert delay and params["pp_size"] == p.pp and len(params["remote_rank_ports"]) == p.tp * p.pp
    d.sched.on_new_request("d1", params)
    n, _ = d.sched.get_num_new_matched_tokens("d1", 16 * len(blocks), 0)
    d.sched.update_state_after_alloc("d1", local, n)
    return params


TWO_STAGES = (LayerSlice(0, 1, 3), LayerSlice(1, 2, 3))  # an uneven split: 1 layer, then 2


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_d_reads_each_layer_from_the_stage_that_holds_it(make, clock, p_tp, d_tp):
    _, p, d = make(p_tp, d_tp, TWO_STAGES)
    pull(p, d)
    assert run(clock, (d, p), 5, until=lambda: "d1" in d.recving and "r1" in p.sending)
    for layer in range(3):
        for src, dst in zip((1, 2, 3), (5, 6, 7)):
            assert torch.equal(d.layer_block(layer, dst), layer_value(layer, src)), f"layer {layer} block {dst}"
    assert torch.count_nonzero(d.layer_block(0, 4)) == 0  # nothing outside the blocks read
    for w in p.workers:  # every rank of every stage: its lease consumed by its planned readers
        assert w.driver.counters["blocks_freed_consumed"] == 3, w.driver.engine_id
    assert p.held() == [] and d.held() == [] and d.failed == set()


def test_p_reports_sent_only_when_every_stage_s_lease_ended(make, clock):
    fabric, p, d = make(1, 1, TWO_STAGES)
    fabric.drop_notifs(receiver="P/tp1", prefix=b"r1-")  # D's completion to stage 1 is lost
    pull(p, d)
    assert run(clock, (d, p), 2, until=lambda: "d1" in d.recving)
    assert run(clock, (d, p), 1, until=lambda: p.sched.waiting_on("r1") == (1,))
    assert p.workers[0].driver.counters["blocks_freed_consumed"] == 3
    assert "r1" not in p.sending and p.workers[1].driver.plane.held() != []
    # Stage 1 frees its blocks at its lease's expiry, never on stage 0's completion; then P reports.
    assert run(clock, (d, p), 30, until=lambda: "r1" in p.sending)
    assert p.workers[1].driver.counters["blocks_freed_expired"] == 3
    assert p.workers[1].driver.counters["blocks_freed_consumed"] == 0
    assert p.held() == [] and d.held() == []


def test_a_stage_of_another_model_is_not_read_and_d_recomputes(make, clock):
    _, p, d = make(1, 1, TWO_STAGES, d_layers=4)  # D's model has 4 layers, P's stages 3
    pull(p, d)
    assert run(clock, (d, p), 5, until=lambda: "d1" in d.failed)
    assert torch.count_nonzero(d.layer_block(1, 5)) == 0
    assert run(clock, (d, p), 30, until=lambda: "r1" in p.sending)  # P's leases expire: nothing leaks
    assert p.held() == [] and d.held() == []


def test_an_engine_running_pp_refuses_to_read(make, clock):
    _, p, d = make(1, 1, TWO_STAGES)
    p.fill((1,))
    d.sched.on_new_request("r0", {"do_remote_decode": True})  # D (PP 1) serves; P (PP 2) would read
    _, params = d.sched.request_finished("r0", (1,))
    with pytest.raises(BadTransferParams, match="pipeline parallel size 2"):
        p.sched.on_new_request("x", params)


# ---------------------------------------------------------------- vLLM's scheduler half at PP 2
def pp_side(name: str, pp: int = 2, tp: int = 1):
    from kvplane.connector.records import RankInfo
    from kvplane.connector.vllm_scheduler import VllmSchedulerSide
    from kvplane.connector.vllm_settings import settings_from

    s = VllmSchedulerSide(name, settings_from({"kvplane_insecure": True}), tp_size=tp, pp_size=pp)
    s.add_ranks({r: RankInfo(rank=r, engine_id=f"{name}/tp{r}", side_channel_port=5700 + 10 * r, public_key=None)
                 for r in range(tp * pp)})
    return s


def test_a_pp_prefill_names_every_stage_and_reports_sent_when_every_stage_did():
    from kvplane.connector.records import WorkerReport
    from vllm_support import Req

    p = pp_side("prefill-0")
    r = Req("x", {"do_remote_decode": True})
    p.on_new_request(r)
    delay, params = p.request_finished(r, (4, 5, 6))
    assert delay and params["pp_size"] == 2 and params["tp_size"] == 1
    assert params["remote_rank_ports"] == [5700, 5710]  # stage 0's rank, stage 1's rank
    assert [g.request_id for g in p.build_step([]).meta.grants] == ["x"]  # one grant, every rank applies it
    p.update_from_workers([WorkerReport(rank=0, finished_sending={"x"})])
    assert "x" not in p.last_report.finished_sending  # stage 1 still holds its layers' blocks
    p.update_from_workers([WorkerReport(rank=1, finished_sending={"x"})])
    assert "x" in p.last_report.finished_sending


def test_a_pp_engine_computes_a_remote_prefill_itself():
    from vllm_support import Req

    p = pp_side("prefill-0")
    d = pp_side("decode-0", pp=1)
    src = Req("y", {"do_remote_decode": True})
    d.on_new_request(src)
    _, params = d.request_finished(src, (1, 2, 3))
    r = Req("z", params)
    p.on_new_request(r)
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)  # computed locally, nothing read
    assert p.counters["bad_transfer_params"] == 1


# ---------------------------------------------------------------- the job's --prefill-pp
@pytest.mark.parametrize("flags,problem", [
    (dict(prefill_pp=3), "1 or 2"), (dict(prefill_pp=True), "1 or 2"),
    (dict(prefill_pp=2, push=True), "pull mode"), (dict(prefill_pp=2, model="hybrid"), "--model tiny"),
    (dict(prefill_pp=2, bidirectional=True), "one turn"), (dict(prefill_pp=2, late_turn2=40.0), "one turn"),
    (dict(prefill_pp=2, prefill_block_size=32, decode_block_size=64), "block size"),
])
def test_the_job_refuses_what_prefill_pp_does_not_run_with(flags, problem):
    import argparse

    from kvplane.app.vllm.run import options_from_args

    with pytest.raises(ValueError, match=problem):
        options_from_args(argparse.Namespace(**flags))


def test_a_pp_engine_runs_traced_and_its_peer_eager():
    from kvplane.app.vllm.engines import EngineSpec

    spec = EngineSpec(name="P", engine_id="prefill-0", http_port=1, side_channel_port=2, connector="kvplane", pp=2)
    cmd = spec.command("/m")
    assert "--enforce-eager" not in cmd and cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    assert '"backend": "eager"' in cmd[cmd.index("--compilation-config") + 1]
    peer = attrs.evolve(spec, name="D", pp=1).command("/m")
    assert "--enforce-eager" in peer and "--compilation-config" not in peer and "--pipeline-parallel-size" not in peer
