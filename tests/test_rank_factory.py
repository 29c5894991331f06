"""One factory builds a worker rank (``connector.rank_factory``) for the main
job's rank process and for vLLM's worker: the rank's engine id, its agent
(behind the fault wrapper when a loss rate is set), its plane's event log
first among its observers, and a worker serving that rank; a rank that
cannot be built closes what it opened."""
from __future__ import annotations

import pytest

from kvplane.connector.rank_factory import RankSetup, build_rank
from kvplane.statemachines import events as E
from kvplane.statemachines.eventlog import read_log
from kvplane.transport.faults import DropNotifications
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric


class Endpoints:
    """A loopback endpoint factory that remembers what it made."""

    def __init__(self):
        self.fabric = LoopbackFabric()
        self.made: list[LoopbackEndpoint] = []

    def __call__(self, name: str) -> LoopbackEndpoint:
        ep = LoopbackEndpoint(self.fabric, name)
        self.made.append(ep)
        return ep


def test_a_rank_with_an_event_log_and_an_observer(tmp_path):
    endpoints, seen = Endpoints(), []
    log = tmp_path / "rank1.events.jsonl"
    rank = build_rank(RankSetup(engine_id="D", rank=1, tp_size=2, log_path=str(log)), observers=(seen.append,),
                      endpoint_factory=endpoints, insecure=True)
    try:
        assert rank.rank_id == "D/tp1" and rank.driver.engine_id == "D/tp1"
        assert [ep.name for ep in endpoints.made] == ["D/tp1"] and rank.endpoint is endpoints.made[0]
        assert rank.faults is None and rank.worker.rank == 1 and rank.worker.tp_size == 2
        assert rank.driver.plane.observers[:2] == (rank.log_writer, seen.append)
        assert log.read_text().startswith('{"v":1')  # the header is there from the start
        rank.driver.plane.handle(E.LeaseGranted(request_id="r1", block_ids=(1,), expected_consumers=1), 0.0)
        assert [type(s.event).__name__ for s in seen] == ["LeaseGranted"]
    finally:
        rank.close_log()
        rank.worker.shutdown()
    records = read_log(str(log)).records
    assert [type(r.event).__name__ for r in records] == ["LeaseGranted"]


def test_a_loss_rate_puts_the_fault_wrapper_between_driver_and_agent():
    endpoints = Endpoints()
    rank = build_rank(RankSetup(engine_id="P", drop_notifications=0.5, fault_seed=3), endpoint_factory=endpoints,
                      insecure=True)
    try:
        assert isinstance(rank.faults, DropNotifications) and rank.faults.inner is rank.endpoint
        assert rank.faults.rate == 0.5 and rank.log_writer is None and rank.log_stream is None
    finally:
        rank.worker.shutdown()


def test_a_rank_that_cannot_be_built_closes_its_agent(tmp_path):
    endpoints = Endpoints()
    with pytest.raises(ValueError, match="out of range"):
        build_rank(RankSetup(engine_id="D", rank=2, tp_size=2, log_path=str(tmp_path / "x.jsonl")),
                   endpoint_factory=endpoints, insecure=True)
    assert endpoints.made and all(ep._closed for ep in endpoints.made)


def test_without_a_factory_the_agent_gets_the_setups_backends_and_threads(monkeypatch):
    import kvplane.connector.rank_factory as factory

    asked, endpoints = [], Endpoints()

    def real(name, setup):  # stands in for the NIXL agent (tests/test_transport_nixl.py runs the real one)
        asked.append((name, setup.nixl_backends, setup.nixl_num_threads))
        return endpoints(name)

    monkeypatch.setattr(factory, "nixl_endpoint", real)
    rank = build_rank(RankSetup(engine_id="P", nixl_backends=("UCX", "POSIX"), nixl_num_threads=2), insecure=True)
    try:
        assert asked == [("P/tp0", ("UCX", "POSIX"), 2)] and rank.endpoint is endpoints.made[0]
    finally:
        rank.worker.shutdown()
