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

from .kv_check import check_all
from .vllm_engines import (EngineProcess, EngineSpec, EngineStartError, kvplane_secret_config, split_cores,
                           wait_healthy)
from .vllm_model import write_tiny_model
from .vllm_proxy import ProxyError, disaggregated, post_json
from .vllm_workload import BLOCK_TOKENS, VOCAB_HI, VOCAB_LO, VllmRequest, make_stream

ENGINE_IDS = {"P": "prefill-0", "D": "decode-0"}


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

    # ------------------------------------------------------------ set-up
    def prepare(self) -> tuple[EngineSpec, EngineSpec]:
        o = self.opts
        if self.out.exists():
            shutil.rmtree(self.out)
        self.dumps.mkdir(parents=True)
        model = write_tiny_model(self.out / "model")
        self.model = model
        http_p, http_d, side_p, side_d = _free_ports(4)
        cores = dict(zip(("P", "D"), split_cores()))
        specs = {}
        for name, http, side in (("P", http_p, side_p), ("D", http_d, side_d)):
            role = "prefill" if name == "P" else "decode"
            extra: dict[str, Any] = {"kv_lease_duration": o.lease, "kvplane_kv_dump_dir": str(self.dumps)}
            if o.connector == "nixl":
                # One UCX worker thread, as kvplane's agent has: NixlConnector's 4
                # spin on the one core each engine gets here (see split_cores).
                extra.update({"num_threads": 1, "kvplane_drop_notifications": o.drop_notifications,
                              "kvplane_fault_seed": _fault_seed(o.seed, name)})
            if o.connector == "kvplane":
                extra.update({
                    "kvplane_event_log": str(self.out / f"{role}.events.jsonl"),
                    "kvplane_status_file": str(self.out / f"{role}.status.json"),
                    "kvplane_drop_notifications": o.drop_notifications,
                    "kvplane_fault_seed": _fault_seed(o.seed, name),
                })
                extra.update(self._keys(name))
            specs[name] = EngineSpec(
                name=name, engine_id=ENGINE_IDS[name], http_port=http, side_channel_port=side,
                connector=o.connector, extra_config=extra, seed=o.seed,
                max_num_seqs=o.d_max_num_seqs if name == "D" else 8,
                num_blocks=o.p_num_blocks if name == "P" else None,
                kv_load_failure_policy="recompute", cpus=cores[name])
        return specs["P"], specs["D"]

    def _keys(self, name: str) -> dict[str, Any]:
        """The run's deployment secret (one file both engines read): P signs
        its params with it, the side channels use its CURVE keypair."""
        return kvplane_secret_config(self.out)

    def start(self, p: EngineSpec, d: EngineSpec) -> float:
        self.say(f"starting two vLLM engines ({self.opts.connector} connector): P on :{p.http_port}, "
                 f"D on :{d.http_port}; this takes 1-3 minutes here")
        for spec in (p, d):
            self.engines[spec.name] = EngineProcess(spec, self.model, self.out / f"{spec.name.lower()}.vllm.log")
        return wait_healthy(list(self.engines.values()), timeout=self.opts.startup_timeout, progress=self.say)

    # ------------------------------------------------------------ the stream
    def run_stream(self, stream: list[VllmRequest]) -> float:
        p, d = self.engines["P"].url, self.engines["D"].url
        self._stream_t0 = t0 = time.monotonic()
        stop_filler = threading.Event()
        filler = None
        if any(r.late for r in stream):
            filler = threading.Thread(target=self._fill_p, args=(p, stop_filler), daemon=True)
            filler.start()
        killer = None
        if self.opts.kill_decode_at is not None:
            killer = threading.Timer(self.opts.kill_decode_at, self._kill_d)
            killer.start()
        with ThreadPoolExecutor(max_workers=16) as pool:
            # The burst first, to the end (it is what waits in D's queue); then the
            # steady stream on its own schedule, so its TTFT is not that queue's.
            for phase in ([r for r in stream if r.burst], [r for r in stream if not r.burst]):
                if not phase:
                    continue
                start, first = time.monotonic(), phase[0].arrival
                futures = []
                for r in phase:
                    delay = start + (r.arrival - first) - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    futures.append(pool.submit(self._one, p, d, r))
                for f in futures:
                    f.result()
                self.say(f"{sum(1 for x in self.results.values() if x.ok)}/{len(stream)} requests done "
                         f"({time.monotonic() - t0:.0f} s)")
        stop_filler.set()
        if filler is not None:
            filler.join(timeout=60)
        if killer is not None:
            killer.cancel()
        return time.monotonic() - t0

    def _one(self, p: str, d: str, r: VllmRequest) -> None:
        res = self.results[r.index] = RequestResult(index=r.index, late=r.late, burst=r.burst,
                                                    repeat_of=r.repeat_of, prompt_tokens=len(r.prompt))
        body = {"model": str(self.model), "prompt": list(r.prompt), "max_tokens": r.max_tokens,
                "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}

        def before_decode(params: dict | None) -> dict | None:
            self.p_done_at.append(time.monotonic())
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

    def _fill_p(self, p: str, stop: threading.Event) -> None:
        """While a late request waits, keep P busy with other prompts, as a
        production P would be: freed blocks get reused."""
        rng = random.Random(self.opts.seed + 1)
        while not stop.is_set():
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
                    "cache_salt": f"kvplane-reference-{r.index}", "kv_transfer_params": {DUMP_KEY: f"{r.tag}.local"}}
            try:
                post_json(f"{d}/v1/completions", body, timeout=self.opts.timeout, leg="reference")
            except ProxyError as exc:
                self.say(f"reference {r.tag}: {exc}")

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(one, todo))

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


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, below Linux's ephemeral range (32768+): a
    port the kernel handed out and took back may go to the next outgoing
    connection before the engine binds it (seen: "Address already in use")."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(20000, 32000)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


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


def _status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the command
def run_vllm(opts: VllmRunOptions, say: Callable[[str], None] = print) -> dict:
    """The whole job; returns the summary (also written to summary.json)."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vLLM is not installed: pip install -e '.[vllm]' and see the README's vLLM section")
    run = VllmRun(opts, say)
    p_spec, d_spec = run.prepare()
    late_every = 4 if opts.late_forward else 0
    stream = make_stream(opts.requests, seed=opts.seed, late_every=late_every)
    summary: dict[str, Any] = {"connector": opts.connector, "options": attrs.asdict(opts)}
    try:
        summary["startup_s"] = run.start(p_spec, d_spec)
        summary["stream_s"] = run.run_stream(stream)
        d_alive = run.engines["D"].alive
        if d_alive:
            run.reference(stream)
        names = ["P", "D"] if d_alive else ["P"]
        settle_timeout = opts.lease + 20.0
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
    verdicts = check_all(run.dumps, [f"r{r.index}" for r in res if r.ok])
    out["kv_check"] = {"checked": len(verdicts), "ok": sum(v.ok for v in verdicts),
                       "tokens_compared": sum(v.read_tokens for v in verdicts),
                       "declined": sum(v.declined for v in verdicts),
                       "no_whole_block_read": sum(1 for v in verdicts if not v.declined and not v.read_tokens),
                       "bad": [(v.tag, v.why) for v in verdicts if not v.ok]}
    late_tags = {f"r{r.index}" for r in res if r.late and r.ok}
    out["kv_check"]["late_bad"] = sum(1 for v in verdicts if v.tag in late_tags and not v.ok)
    if opts.connector == "kvplane":
        status = {role: _status(run.out / f"{role}.status.json") for role in ("prefill", "decode")}
        out["status"] = status
        counts = {role: (s or {}).get("counts", {}) for role, s in status.items()}
        gauges = {role: (s or {}).get("gauges", {}) for role, s in status.items()}
        out["bytes_moved"] = counts["decode"].get("bytes_transferred", 0)
        out["declined_reads"] = counts["decode"].get("kvplane_declined_reads", 0)
        out["failed_recvs"] = counts["decode"].get("kvplane_failed_recvs", 0)
        out["lease_extensions"] = counts["prefill"].get("kvplane_lease_extensions", 0)
        out["leases_expired"] = counts["prefill"].get("num_kv_expired_reqs", 0)
        out["leases_consumed"] = counts["prefill"].get("kvplane_leases_consumed", 0)
        out["protocol_errors"] = sum(c.get("kvplane_protocol_errors", 0) for c in counts.values())
        out["connector_blocks_held"] = {role: g.get("kvplane_blocks_held") for role, g in gauges.items()}
        out["connector_recvs_in_flight"] = {role: g.get("kvplane_recvs_in_flight") for role, g in gauges.items()}
        out["replay"] = {role: _replay(run.out / f"{role}.events.jsonl") for role in ("prefill", "decode")}
    else:
        d_metrics = summary.get("metrics", {}).get("D", {})
        out["bytes_moved"] = int(d_metrics.get("vllm:nixl_bytes_transferred_sum", 0))
        out["declined_reads"] = 0  # NixlConnector has no such decision
        out["failed_transfers"] = int(d_metrics.get("vllm:nixl_num_failed_transfers_total", 0))
    return out


def _replay(path: Path) -> dict:
    from kvplane.statemachines.eventlog import EventLogError
    from kvplane.statemachines.replay import replay

    if not path.exists():
        return {"ok": False, "why": "no event log"}
    try:
        r = replay(path)
    except EventLogError as exc:
        return {"ok": False, "why": str(exc)}
    return {"ok": r.ok, "lines": r.lines, "held": len(r.held),
            "divergence": None if r.divergence is None else str(r.divergence)}


# The sim job's flags this job does not have: each refused by name.
_SIM_ONLY = ("push", "hang_decode_at", "rank", "prefill_tp", "decode_tp", "clock_skew", "overload", "hold_ttl")


def options_from_args(args: Any) -> VllmRunOptions:
    sim_defaults = {"push": False, "hang_decode_at": None, "rank": None, "prefill_tp": 1, "decode_tp": 1,
                    "clock_skew": 0.0, "overload": 2.0, "hold_ttl": 4.0}
    for name in _SIM_ONLY:
        if getattr(args, name, sim_defaults[name]) != sim_defaults[name]:
            raise ValueError(f"--{name.replace('_', '-')} is not available with --engine vllm (TP 1, pull mode)")
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
    if not 0 <= opts.drop_notifications < 1:
        raise ValueError(f"--drop-notifications must be in [0, 1), got {opts.drop_notifications:g}")
    for name in ("late_forward", "kill_decode_at"):
        v = getattr(opts, name)
        if v is not None and (not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf")):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v!r}")
    if opts.late_forward is not None and opts.kill_decode_at is not None:
        raise ValueError("--late-forward and --kill-decode-at are one fault each: pick one")
    return opts


def cmd_run_vllm(args: Any) -> int:
    from rich.console import Console
    from rich.markup import escape

    from .vllm_report import print_report, side_by_side

    console = Console()
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        console.print(f"[red]kvplane run: {escape(str(exc))}[/red]", soft_wrap=True)
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
                for role in ("prefill", "decode"):
                    console.print(f"{role} event log: {Path(one.out) / f'{role}.events.jsonl'}", highlight=False)
            # Side by side, NixlConnector's outcome is a finding, not our failure.
            ok &= passed or (len(names) > 1 and name == "nixl")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; engines stopped[/yellow]")
        return 130
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
