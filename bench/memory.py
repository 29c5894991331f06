"""Item 2: memory and GC cost per in-flight request.

The population is N decode requests in flight with a READ posted (the state
that holds the most: heartbeat registration, engine reference, transfer,
deadline), spread over 64 connected engines.  Bytes per request come from
tracemalloc (everything retained, including the request-id strings and
block-id tuples, which every implementation keeps); GC cost is the time of a
full ``gc.collect()`` with the population alive, and the number of
GC-tracked objects each request adds.
"""
from __future__ import annotations

import gc
import linecache
import time
import tracemalloc
from pathlib import Path

import kvplane.statemachines
from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.plane import ControlPlane

from . import workload as W
from .dictbaseline import DictDecodeSide
from .report import Table, add_target, ratio, targets_table
from .tmodels import ref_machines, shared_machines

CFG = PlaneConfig()
TRACKED_GOAL = 2
# Allocations made by these files are the implementation's own; the request
# ids, engine ids, block-id tuples and times the bench builds are not.
# (the folder as imported: kvplane/statemachines, a link, names the files tracemalloc sees)
_STATEMACHINES = str(Path(kvplane.statemachines.__file__).parent) + "/*"
_DICTS = str(Path(__file__).resolve().parent / "dictbaseline.py")


def _populate_plane(machines):
    def build(n: int):
        plane = ControlPlane(CFG, machines() if machines else None)
        W.connect_plane(plane, 1000.0)
        return plane, lambda: _fill_plane(plane, n)

    build.own_files = _STATEMACHINES  # type: ignore[attr-defined]
    return build


def _fill_plane(plane: ControlPlane, n: int) -> None:
    t = 1000.0
    handle = plane.handle
    for i in range(n):
        r = f"r{i}"
        handle(E.NewRequest(request_id=r, engine_id=W.engine_of(i), remote_request_id="p" + r,
                            remote_block_ids=(1, 2, 3, 4)), t)
        handle(E.BlocksAllocated(request_id=r, block_ids=(5, 6, 7, 8), num_remote_tokens=64), t)
        handle(E.StartLoad(request_id=r), t)
        t += 1e-6
    assert sum(1 for x in plane.instances["decode_request"].values() if x.state == "READING") == n


def _populate_dict(n: int):
    d = DictDecodeSide(CFG)
    W.connect_dict(d, 1000.0)

    def fill():
        t = 1000.0
        for i in range(n):
            r = f"r{i}"
            d.new_request(r, W.engine_of(i), "p" + r, (1, 2, 3, 4), (0,), 1, t)
            d.blocks_allocated(r, (5, 6, 7, 8), 64, t)
            d.start_load(r, t)
            t += 1e-6
            if len(d.out) > 4096:
                d.out.clear()  # the transport consumes actions every step
        d.out.clear()
        assert len(d._recving_transfers) == n

    return d, fill


_populate_dict.own_files = _DICTS  # type: ignore[attr-defined]


def measure(build, n: int, traced: bool = True) -> dict[str, float]:
    gc.collect()
    holder, fill = build(n)
    tracked0 = len(gc.get_objects())
    if traced:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        before = tracemalloc.take_snapshot()
    t0 = time.perf_counter()
    fill()
    fill_s = time.perf_counter() - t0
    gc.collect()
    out = {"fill_s": fill_s}
    if traced:
        out["bytes_per_request"] = (tracemalloc.get_traced_memory()[0] - base) / n
        own = getattr(build, "own_files", None)
        if own is not None:
            # What the implementation's own code allocated and still holds.
            keep = [tracemalloc.Filter(True, own)]
            after = tracemalloc.take_snapshot().filter_traces(keep)
            grown = sum(st.size_diff for st in after.compare_to(before.filter_traces(keep), "filename"))
            out["own_bytes_per_request"] = grown / n
            out["by_line"] = _by_line(after, before.filter_traces(keep), n)
        tracemalloc.stop()
    if isinstance(holder, ControlPlane):
        live = sum(1 for insts in holder.instances.values() for i in insts.values() if i.deadline is not None)
        out["timer_entries_per_live"] = len(holder.timer_entries()) / live
    out["tracked_per_request"] = (len(gc.get_objects()) - tracked0) / n
    out["gc_ms"] = _gc_ms()
    del holder, fill
    gc.collect()
    return out


def _by_line(after, before, n: int, top: int = 8) -> list[dict]:
    """What holds the own bytes, per request: the lines that allocated them, largest first."""
    rows = []
    for st in after.compare_to(before, "lineno")[:top]:
        frame = st.traceback[0]
        code = linecache.getline(frame.filename, frame.lineno).strip()
        rows.append({"where": f"{Path(frame.filename).name}:{frame.lineno}", "code": code, "bytes": st.size_diff / n,
                     "objects": st.count_diff / n})
    return rows


def _gc_ms(repeat: int = 5) -> float:
    # Minimum, as timeit does: a collection's own work is fixed, noise only adds.
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def run(quick: bool) -> list[Table]:
    sizes = (1_000, 10_000) if quick else (1_000, 10_000, 100_000, 1_000_000)
    # The transitions variants are capped: a Machine per request costs ~40 KB
    # and ~0.5 ms to build (100k: ~4 GB, minutes), and add_model/remove_model
    # scan the Machine's model list, so the shared variant grows quadratically.
    # Above 1k they run without tracemalloc (it triples build time); their
    # bytes per request, constant per instance, come from the traced 1k run.
    t_cap = 1_000 if quick else 10_000
    impls = [
        ("kvplane ControlPlane", _populate_plane(None), None),
        ("(a) transitions, Machine per request", _populate_plane(ref_machines), t_cap),
        ("(a') transitions, shared Machine", _populate_plane(shared_machines), t_cap),
        ("(b) dict baseline", _populate_dict, None),
    ]
    gc.collect()
    base_gc = _gc_ms(5)
    t = Table("memory.per_request", "Memory and GC per in-flight request (decode requests with a READ posted, 64 engines)",
              ["implementation", "in flight", "bytes / request", "own bytes / request (no ids, blocks)",
               "GC-tracked objects / request", "timer heap entries / live deadline", "full gc.collect() ms",
               "bytes vs (b)", "gc.collect vs (b)"])
    rows = []
    for name, build, cap in impls:
        traced_bytes = None
        for n in sizes:
            if cap is not None and n > cap:
                rows.append((name, n, None))
                continue
            traced = cap is None or n <= 1_000
            m = measure(build, n, traced)
            if traced:
                traced_bytes = m["bytes_per_request"]
            else:
                m["bytes_per_request"] = traced_bytes
                m["bytes_from_1k_sample"] = True
            rows.append((name, n, m))
    dict_at = {n: m for name, n, m in rows if name.startswith("(b)") and m}
    for name, n, m in rows:
        if m is None:
            t.add(name, f"{n:,}", "not run", None, None, None, None, None, None, implementation=name, in_flight=n,
                  skipped=True)
            continue
        b = dict_at.get(n)
        by = m["bytes_per_request"]
        t.add(name, f"{n:,}", f"≈{by:,.0f}" if m.get("bytes_from_1k_sample") else by, m.get("own_bytes_per_request"),
              m["tracked_per_request"], m.get("timer_entries_per_live"), m["gc_ms"], ratio(by, b and b["bytes_per_request"]), ratio(m["gc_ms"], b and b["gc_ms"]),
              implementation=name, in_flight=n, **{k: round(v, 3) if isinstance(v, float) else v for k, v in m.items() if k != "by_line"})
    t.notes += [
        "bytes / request: tracemalloc, retained after the population is built and a gc.collect(); includes the "
        "request-id strings and block-id tuples (every implementation keeps those) and, for the plane, the timer "
        "heap's entries. own bytes: what the implementation's own files (statemachines/, bench/dictbaseline.py) "
        "allocated and still hold, i.e. without the request and engine ids, block-id tuples and times the bench "
        "builds. ≈: from the traced 1k run of the same implementation.",
        "timer heap entries / live deadline: lazy deletion leaves a superseded entry when a deadline moves (a READ "
        "posted moves its recv deadline earlier); the plane compacts the heap when it doubles.",
        f"full gc.collect() ms: best of 5 with the population alive; the same collection with no population "
        f"takes {base_gc:.1f} ms in this process.",
        f"The transitions variants stop at {t_cap:,}: a Machine per request is ~40 KB and ~0.5 ms to build (~4 GB "
        "and minutes at 100k); a shared Machine's add_model/remove_model scan its model list (O(models) each, "
        "quadratic to fill), so 100k would take tens of minutes.",
    ]
    goals = targets_table("memory.targets", "memory (issue 13, target 2; the bytes target retired by issue 31)")
    big = max(sizes)
    m = next(m for name, n, m in rows if name == "kvplane ControlPlane" and n == big)
    parts = Table("memory.by_line", f"What holds the plane's own bytes at {big:,} in flight, per request (the lines "
                  "that allocated them, largest first)", ["bytes / request", "objects / request", "allocated at", "code"])
    for line in m["by_line"]:
        parts.add(line["bytes"], line["objects"], line["where"], f"`{line['code']}`", **line)
    parts.notes.append("tracemalloc grouped by the allocating line (the first frame), from the same population as "
                       "the table above.  Fractions of an object: containers shared per "
                       "engine (its reference set, its heartbeat batch) grow by a slot per request, and "
                       "superseded timer entries not yet compacted.")
    tracked, entries = m["tracked_per_request"], m["timer_entries_per_live"]
    # Memory is reported as a ratio to the hand-written dict holding the same population (no target: issue 31
    # retired the 300 B one, which was below the dict's own figure).
    d = dict_at.get(big)
    if d is not None:
        t.notes.append(f"At {big:,} in flight the plane holds {m['bytes_per_request'] / d['bytes_per_request']:.2f}x "
                       f"the hand-written dict's bytes per request ({m['bytes_per_request']:,.0f} B against "
                       f"{d['bytes_per_request']:,.0f} B, ids and block tuples included on both sides).")
    add_target(goals, f"2. GC-tracked objects per in-flight request at {big:,}", f"{tracked:.2f}",
               f"<= {TRACKED_GOAL}", tracked <= TRACKED_GOAL, check="tracked", in_flight=big, tracked=tracked)
    add_target(goals, f"2. superseded timer entries compacted: heap entries per live deadline at {big:,}",
               f"{entries:.2f}", "<= 2 (compaction bound)", entries <= 2.0, check="timer_entries", entries=entries)
    return [t, parts, goals]
