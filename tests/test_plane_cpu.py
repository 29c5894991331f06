"""app.job.plane_cpu: the plane's CPU time as `kvplane run` reports it per request."""
from kvplane.app.job.plane_cpu import PlaneCpu
from kvplane.statemachines import events as E
from kvplane.statemachines.plane import ControlPlane


def test_handle_and_fire_due_are_timed_once_each():
    p = ControlPlane()
    cpu = PlaneCpu().attach(p)
    p.handle(E.LeaseGranted(request_id="l1", block_ids=(1,)), 0.0)
    for t in range(1, 200):
        p.handle(E.LeaseHeartbeat(request_id="l1"), t * 0.01)
    assert cpu.calls == 200 and cpu.seconds > 0
    # fire_due calls handle for each due timer: counted once, as the fire_due call.
    acts = p.fire_due(1e6)
    assert [a.__class__.__name__ for a in acts] == ["FreeBlocks"]
    assert cpu.calls == 201
    assert 0 <= cpu.gc_seconds <= cpu.seconds
    assert p.get("lease", "l1") is None  # the wrapped plane still did its work


def test_apart_moves_an_observers_time_out_of_the_plane():
    import time

    p = ControlPlane()
    cpu = PlaneCpu()
    slow_calls = []

    def slow_observer(step):  # stands for the job's own counting: burns CPU inside handle
        slow_calls.append(step)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.002:
            pass

    p.recorder = cpu.apart(slow_observer)
    cpu.attach(p)
    for i in range(10):
        p.handle(E.LeaseGranted(request_id=f"l{i}", block_ids=(1,)), 0.0)
    assert len(slow_calls) == 10
    assert cpu.apart_seconds >= 0.02  # each call burned 2 ms in the observer
    assert 0 < cpu.seconds < cpu.apart_seconds  # the plane's own share, without the observer's
    cpu.apart(slow_observer)(None)  # called outside a measured call: nothing moves
    assert len(slow_calls) == 11 and cpu.apart_seconds < 0.03
