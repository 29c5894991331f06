"""Connectors timed per engine step, for ``python -m bench connector``.

vLLM loads these through ``kv_connector_module_path = "bench.connector_timed"``
(the engine needs the checkout on its ``PYTHONPATH``; the bench sets it):
``TimedKVPlaneConnector`` is kvplane's ``KVPlaneConnector`` and
``TimedNixlConnector`` vLLM's own ``NixlConnector``, each wrapped the same way
by ``timed``: every per-step method of ``KVConnectorBase_V1`` (``STEP_METHODS``)
is timed with ``time.perf_counter`` (wall time inside the method: what the
engine's step waits for), a method called from inside another timed one
counted once.  One engine process (the scheduler and, at TP 1, the worker
with it) sums those times over an engine step: a step ends when the
scheduler's ``build_connector_meta`` returns (once per ``schedule()``), so a
step's sum holds the previous forward's worker calls, the output's
``update_connector_output`` / ``request_finished`` and this schedule's
calls.  A process with a worker but no scheduler (TP > 1) ends its steps at
``clear_connector_metadata``.

Each step appends a JSON line ``{"t": unix time, "s": seconds, "m": {method:
seconds}}`` to ``<kvplane_bench_dir>/steps.<role>.<pid>.jsonl``
(``kv_connector_extra_config["kvplane_bench_dir"]``); the worker side also
writes ``threads.<pid>.json`` once its KV caches are registered: the native
ids of kvplane's ticker thread (the bench reads its CPU from /proc).
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from kvplane.connector.vllm import KVPlaneConnector

# The methods vLLM calls on every engine step (or per request within one).
# Start-up and shutdown methods (register_kv_caches, handshakes, metrics
# set-up, shutdown) are not timed.
STEP_METHODS = (
    # scheduler side
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "request_finished_all_groups", "on_new_request", "take_events", "has_pending_block_frees",
    "has_pending_push_work", "get_finished_count", "get_loaded_kv_cache_group_ids",
    # worker side
    "bind_connector_metadata", "clear_connector_metadata", "handle_preemptions", "start_load_kv",
    "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "get_kv_connector_stats", "get_kv_connector_kv_cache_events", "build_connector_worker_meta", "finish_forward",
    "get_transfer_results",
)
FLUSH_EVERY = 1  # steps between writes (1: the bench reads the files while the engines run, idle ones too)


class StepClock:
    """One process's per-step sums (every timed connector instance of the process adds to it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()  # nesting depth of timed calls, per thread
        self.spent = 0.0
        self.by_method: dict[str, float] = {}
        self.lines: list[str] = []
        self.stream: TextIO | None = None
        self.scheduler_here = False

    def open(self, folder: str, role: str) -> None:
        with self.lock:
            if role == "scheduler":
                self.scheduler_here = True
            if self.stream is None:
                Path(folder).mkdir(parents=True, exist_ok=True)
                self.stream = open(Path(folder) / f"steps.{os.getpid()}.jsonl", "a", encoding="utf-8")
                atexit.register(self.flush)

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.spent += seconds
            self.by_method[name] = self.by_method.get(name, 0.0) + seconds

    def end_step(self) -> None:
        with self.lock:
            self.lines.append(json.dumps({"t": time.time(), "s": self.spent,
                                          "m": {k: round(v, 9) for k, v in self.by_method.items()}}))
            self.spent = 0.0
            self.by_method = {}
            if len(self.lines) >= FLUSH_EVERY:
                self._write()

    def flush(self) -> None:
        with self.lock:
            self._write()

    def _write(self) -> None:
        if self.stream is not None and self.lines:
            self.stream.write("\n".join(self.lines) + "\n")
            self.stream.flush()
        self.lines = []


CLOCK = StepClock()


def _timed_method(name: str, fn: Any) -> Any:
    counter = time.perf_counter

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        local = CLOCK.local
        depth = getattr(local, "depth", 0)
        if depth:
            return fn(self, *args, **kwargs)
        local.depth = 1
        t0 = counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            CLOCK.add(name, counter() - t0)
            local.depth = 0
            if name == "build_connector_meta" or (name == "clear_connector_metadata" and not CLOCK.scheduler_here):
                CLOCK.end_step()

    call.__name__ = name
    return call


def timed(cls: type) -> type:
    """``cls`` with each of ``STEP_METHODS`` it has timed (see the module docstring)."""

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        cls.__init__(self, vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._bench_dir = extra.get("kvplane_bench_dir")
        if self._bench_dir:
            CLOCK.open(str(self._bench_dir), getattr(role, "name", str(role)).lower())

    def register_kv_caches(self: Any, kv_caches: Any) -> None:
        cls.register_kv_caches(self, kv_caches)
        if self._bench_dir:
            tickers = [t.native_id for t in threading.enumerate() if t.name.startswith("kvplane-ticker")]
            (Path(self._bench_dir) / f"threads.{os.getpid()}.json").write_text(json.dumps({"ticker": tickers}))

    members: dict[str, Any] = {"__init__": __init__, "register_kv_caches": register_kv_caches, "__module__": __name__}
    for name in STEP_METHODS:
        fn = getattr(cls, name, None)
        if not callable(fn):
            continue
        members[name] = _timed_method(name, fn)
    return type(f"Timed{cls.__name__}", (cls,), members)


TimedKVPlaneConnector = timed(KVPlaneConnector)
TimedNixlConnector = timed(NixlConnector)
