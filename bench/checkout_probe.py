"""What ``bench.compare_checkouts`` times inside one checkout.

Run as a script with ``PYTHONPATH`` set to the checkout under test (so
``kvplane`` is that checkout's), from any checkout: it imports nothing of
``bench``, so both sides of a comparison run this same file, the same
workloads, against their own ``kvplane``.  Prints one JSON list: each
workload's CPU microseconds per unit (``--explorer``: then the explorer's
states per CPU second last).
"""
from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time

from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.eventlog import EventLogWriter
from kvplane.statemachines.machines import MACHINES
from kvplane.statemachines.plane import ControlPlane

CFG = PlaneConfig()
HEARTBEATS = 4


def machine_heartbeat(n: int) -> int:
    m = MACHINES["lease"]
    inst = m.new("p1")
    m.handle(inst, E.LeaseGranted(request_id="p1", block_ids=(1, 2, 3)), CFG, 0.0)
    ev, handle, t = E.LeaseHeartbeat(request_id="p1"), m.handle, 0.0
    for _ in range(n):
        t += 0.001
        handle(inst, ev, CFG, t)
    return n


def plane_heartbeat(n: int) -> int:
    p = ControlPlane(CFG)
    p.handle(E.LeaseGranted(request_id="p1", block_ids=(1, 2, 3)), 0.0)
    ev, handle, t = E.LeaseHeartbeat(request_id="p1"), p.handle, 0.0
    for _ in range(n):
        t += 0.001
        handle(ev, t)
    return n


def decode_events(rid: str) -> list:
    return [
        E.NewRequest(request_id=rid, engine_id="P0", remote_request_id="p" + rid, remote_block_ids=(7, 8)),
        E.BlocksAllocated(request_id=rid, block_ids=(1, 2), num_remote_tokens=32),
        E.StartLoad(request_id=rid),
        E.ReadDone(request_id=rid),
        E.RequestRunning(request_id=rid),
        E.RequestFinished(request_id=rid),
    ]


def lease_events(rid: str) -> list:
    return ([E.LeaseGranted(request_id=rid, block_ids=(1, 2, 3, 4))]
            + [E.LeaseHeartbeat(request_id=rid) for _ in range(HEARTBEATS)]
            + [E.ConsumerDone(request_id=rid, consumer="D0", expected_consumers=1)])


def machine_lifecycle(n: int) -> int:
    """Events built inside the loop (counted), EngineReady fed by hand."""
    m, handle, t = MACHINES["decode_request"], MACHINES["decode_request"].handle, 0.0
    for i in range(n // 7):
        rid = f"r{i}"
        evs = decode_events(rid)
        inst = m.new(rid)
        t += 0.001
        for ev in evs[:3]:
            handle(inst, ev, CFG, t)
        handle(inst, E.EngineReady(kind="decode_request", request_id=rid, engine_id="P0"), CFG, t)
        for ev in evs[3:]:
            handle(inst, ev, CFG, t)
    return n // 7 * 7


def _connected(recording: bool) -> tuple[ControlPlane, EventLogWriter | None]:
    p = ControlPlane(CFG)
    writer = EventLogWriter.attach(p, io.StringIO()) if recording else None
    p.handle(decode_events("warm")[0], 0.0)
    p.handle(E.HandshakeOk(engine_id="P0", samples=((0.0, 0.001),)), 0.0)
    return p, writer


def _requests(events_of, recording: bool, n: int) -> int:
    """n requests through a plane (events built inside the loop, counted); returns n."""
    p, writer = _connected(recording)
    handle, t = p.handle, 0.0
    for i in range(n):
        t += 0.001
        for ev in events_of(f"r{i}"):
            handle(ev, t)
        if writer is not None and i % 512 == 511:
            writer.flush()
            writer.stream.seek(0)
            writer.stream.truncate()
    p.fire_due(t)
    return n


def plane_lifecycle(n: int) -> int:
    return _requests(decode_events, False, n // 6) * 6


def decode_request_recorded(n: int) -> int:
    return _requests(decode_events, True, n // 6)


def lease_recorded(n: int) -> int:
    return _requests(lease_events, True, n // 6)


# ---------------------------------------------------------------- the vLLM connector's scheduler halves
# (no vLLM: a stand-in for what the connector reads of vLLM's Request; a deployment secret, as shipped)
PROMPT_TOKENS = 40  # 3 blocks of 16


class _Status:
    name = "FINISHED_LENGTH_CAPPED"


class _Request:
    def __init__(self, request_id: str, params: dict, computed: int) -> None:
        self.request_id, self.kv_transfer_params = request_id, params
        self.num_prompt_tokens, self.num_computed_tokens = PROMPT_TOKENS, computed
        self.status = _Status()
        self.prompt_token_ids = self.all_token_ids = list(range(7, 7 + PROMPT_TOKENS))


def _scheduler_half(name: str, secret: str):
    from kvplane.connector.records import RankInfo
    from kvplane.connector.vllm_scheduler import VllmSchedulerSide
    from kvplane.connector.vllm_settings import settings_from

    side = VllmSchedulerSide(name, settings_from({"kvplane_secret_file": secret}, environ={}),
                             warn=lambda *args: None)
    side.add_ranks({0: RankInfo(rank=0, engine_id=f"{name}/tp0", side_channel_port=5700, public_key=None)})
    return side


_SECRETS = tempfile.TemporaryDirectory(prefix="kvplane-probe-")  # removed when the probe exits


def _secret() -> str:
    path = os.path.join(_SECRETS.name, "kvplane.secret")
    with open(path, "w") as f:
        f.write("a" * 64 + "\n")
    return path


def _grants(p, n: int, tag: str) -> list[_Request]:
    """n requests P served: each its on_new_request, then request_finished (lease, signed params)."""
    out = []
    for i in range(n):
        req = _Request(f"{tag}{i}", {"do_remote_decode": True}, PROMPT_TOKENS)
        p.on_new_request(req)
        out.append(req)
    return out


def connector_p_grant(n: int) -> tuple[int, float]:
    """P's request_finished per request: the lease granted, the params signed (µs/request)."""
    p = _scheduler_half("prefill-0", _secret())
    reqs = _grants(p, n, "g")
    t0 = time.process_time()
    for req in reqs:
        p.request_finished(req, (4, 5, 6))
    return n, time.process_time() - t0


def connector_d_accept(n: int) -> tuple[int, float]:
    """D's on_new_request per request: P's signed params checked and registered (µs/request)."""
    secret = _secret()
    p, d = _scheduler_half("prefill-0", secret), _scheduler_half("decode-0", secret)
    reqs = []
    for i, req in enumerate(_grants(p, n, "x")):
        params = p.request_finished(req, (4, 5, 6))[1]
        if params is None:  # D would register nothing: the figure would time a no-op
            raise RuntimeError(f"P granted no params for {req.request_id}")
        reqs.append(_Request(f"a{i}", params, 0))
    t0 = time.process_time()
    for req in reqs:
        d.on_new_request(req)
    return n, time.process_time() - t0


def connector_empty_step(n: int) -> tuple[int, float]:
    """A scheduler step with nothing to tell: build_step, stats, the workers' empty reports (µs/step)."""
    p = _scheduler_half("prefill-0", _secret())
    build, stats, update = p.build_step, p.stats, p.update_from_workers
    t0 = time.process_time()
    for _ in range(n):
        build([])
        stats()
        update([])
    return n, time.process_time() - t0


# (name, function): each returns how many units it did (events, requests or steps), or (units, CPU
# seconds) when it times only part of its work itself.
WORKLOADS = (("machine_heartbeat", machine_heartbeat), ("plane_heartbeat", plane_heartbeat),
             ("machine_lifecycle", machine_lifecycle), ("plane_lifecycle", plane_lifecycle),
             ("decode_request_recorded", decode_request_recorded), ("lease_recorded", lease_recorded),
             ("connector_d_accept", connector_d_accept), ("connector_p_grant", connector_p_grant),
             ("connector_empty_step", connector_empty_step))


def per_unit(fn, n: int) -> float:
    t0 = time.process_time()
    done = fn(n)
    units, seconds = done if isinstance(done, tuple) else (done, time.process_time() - t0)
    return seconds / units * 1e6


def explorer_states_per_cpu_s() -> float:
    from kvplane.statemachines.explorer import explore

    t0 = time.process_time()
    r = explore()
    return r.states / (time.process_time() - t0)


def main(argv: list[str]) -> None:
    n = 30_000
    # Warm up first: a checkout may do one-time work on its first plane (6021342
    # compiled its generated rows then, about 0.2 s), which is not a per-event cost.
    for _, fn in WORKLOADS:
        fn(600)
    got = [per_unit(fn, n) for _, fn in WORKLOADS]
    if "--explorer" in argv:
        got.append(explorer_states_per_cpu_s())
    print(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1:])
