"""A short recorded loopback run for the sequence-diagram tests: P and D
(PlaneDriver over the loopback transport, real ZMQ handshakes, a
hand-driven clock), two pull requests that D keeps queued for a few
heartbeats, then reads; both planes' event logs as JSONL lines."""
from __future__ import annotations

from loopback_support import Clock, Side, run

from kvplane.connector.driver import introduce
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.eventlog import MemoryLog
from kvplane.transport.loopback import LoopbackFabric

ELEMS = 64
# An id a label must escape: Mermaid statement, entity and comment
# characters, a quote and markup (wire rules forbid only ':' and ',').
ODD_ID = 'r2;#"%%<b>'
REQUESTS = (("r1", "d1", (1, 2), (5, 6)), (ODD_ID, "d2", (3,), (7,)))


def _recorded_side(fabric, name, clock, cfg) -> Side:
    side = Side(fabric, name, clock, cfg, elems=ELEMS)
    side.log = MemoryLog(config=cfg)
    side.driver.plane.recorder = side.log
    return side


def recorded_pull() -> dict[str, list[str]]:
    """{"P": lines, "D": lines} of the run."""
    fabric, clock = LoopbackFabric(), Clock()
    cfg = PlaneConfig(kv_lease_duration=6, transfer_timeout=2.0, recv_timeout=10.0, handshake_timeout=2.0)
    p, d = _recorded_side(fabric, "P", clock, cfg), _recorded_side(fabric, "D", clock, cfg)
    introduce(p.driver, d.driver)
    try:
        for pid, did, blocks, _ in REQUESTS:
            p.sched.on_new_request(pid, {"do_remote_decode": True})
            _, params = p.sched.request_finished(pid, blocks)
            d.sched.on_new_request(did, params)
        # Queued on D for a while: heartbeats keep P's leases alive.
        run(clock, (d, p), 3.0)
        for _, did, blocks, local in REQUESTS:
            n, _ = d.sched.get_num_new_matched_tokens(did, 16 * len(blocks), 0)
            d.sched.update_state_after_alloc(did, local, n)
        done = {pid for pid, *_ in REQUESTS}
        assert run(clock, (d, p), 5.0, until=lambda: done <= p.sending)
        return {"P": p.log.lines(), "D": d.log.lines()}
    finally:
        for s in (p, d):
            s.worker.shutdown()
