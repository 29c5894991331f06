"""kvplane's TTFT against vLLM's NixlConnector, side by side in one run.

Four real vLLM engines at once: a P/D pair with KVPlaneConnector and a P/D
pair with NixlConnector (both P pinned to one core, both D to the other,
so each pair sees the same machine).  The same prompts go through the
disaggregated proxy protocol to one pair and then the other, alternating
which goes first, one request at a time: each TTFT (client send to D's
first token) of one connector is measured right beside the other's.  The
figure is the ratio of the medians; the issue's target is kvplane within
5% of NixlConnector.  Needs vLLM (scripts/install-vllm); start-up takes
minutes.  Not a test: a timing on a shared machine informs, never gates.
"""
from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from .report import Table, ratio

TARGET = 1.05


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(quick: bool) -> list[Table]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return [Table(key="vllm.targets", title="targets: vllm", columns=["target", "measured", "goal", "met"],
                      rows=[["kvplane TTFT p50 / NixlConnector TTFT p50 (vLLM, one run)",
                             "not run: vLLM is not installed (scripts/install-vllm)", "<= 1.05x", "NO"]])]
    from kvplane.app.vllm.engines import EngineProcess, EngineSpec, kvplane_secret_config, split_cores, wait_healthy
    from kvplane.app.vllm.model import write_tiny_model
    from kvplane.app.vllm.proxy import disaggregated
    from kvplane.app.vllm.run import _free_ports

    rounds = 12 if quick else 40
    work = Path(tempfile.mkdtemp(prefix="kvplane-bench-vllm-"))
    model = write_tiny_model(work / "model")
    p_cores, d_cores = split_cores()
    ports = _free_ports(8)
    engines: dict[str, dict[str, EngineProcess]] = {}
    try:
        for k, connector in enumerate(("kvplane", "nixl")):
            extra = {"num_threads": 1} if connector == "nixl" else kvplane_secret_config(work)
            pair = {}
            for j, (name, cores) in enumerate((("P", p_cores), ("D", d_cores))):
                spec = EngineSpec(name=name, engine_id=f"{connector}-{name}", http_port=ports[4 * k + j],
                                  side_channel_port=ports[4 * k + 2 + j], connector=connector,
                                  extra_config=extra, cpus=cores, max_num_seqs=4)
                pair[name] = EngineProcess(spec, model, work / f"{connector}-{name}.log")
            engines[connector] = pair
        startup = wait_healthy([e for pair in engines.values() for e in pair.values()], timeout=900,
                               progress=lambda line: print(f"  {line}", flush=True))
        rng = random.Random(0)
        ttft: dict[str, list[float]] = {"kvplane": [], "nixl": []}
        legs: dict[str, list[tuple[float, float]]] = {"kvplane": [], "nixl": []}  # (P leg, D to first token)
        failed: dict[str, int] = {"kvplane": 0, "nixl": 0}
        for i in range(rounds):
            prompt = [rng.randrange(3, 1023) for _ in range(rng.randrange(128, 1024))]
            body = {"model": str(model), "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
            order = ("kvplane", "nixl") if i % 2 == 0 else ("nixl", "kvplane")
            for connector in order:
                pair = engines[connector]
                try:
                    got = disaggregated(pair["P"].url, pair["D"].url, body, timeout=120)
                except Exception:  # a failed request is counted, not timed
                    failed[connector] += 1
                    continue
                ttft[connector].append(got.p_seconds + got.d_ttft_seconds)
                legs[connector].append((got.p_seconds, got.d_ttft_seconds))
            time.sleep(0.05)
    finally:
        for pair in engines.values():
            for e in pair.values():
                e.stop(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    med = {c: statistics.median(v) if v else float("nan") for c, v in ttft.items()}
    p99 = {c: sorted(v)[min(len(v) - 1, round(0.99 * (len(v) - 1)))] if v else float("nan") for c, v in ttft.items()}
    r = med["kvplane"] / med["nixl"]
    detail = Table(
        key="vllm.ttft", title="vLLM P/D TTFT, kvplane vs NixlConnector (4 engines at once, alternating requests)",
        columns=["connector", "requests", "failed", "TTFT p50 ms", "TTFT p99 ms", "P leg p50 ms",
                 "D to first token p50 ms"],
        rows=[[c, len(ttft[c]), failed[c], round(med[c] * 1000, 1), round(p99[c] * 1000, 1),
               round(_median([p for p, _ in legs[c]]) * 1000, 1), round(_median([d for _, d in legs[c]]) * 1000, 1)]
              for c in ("kvplane", "nixl")],
        notes=[f"engines started in {startup:.0f} s; prompts 128-1023 tokens, 4 output tokens; TTFT = client "
               "send to D's first token (P's leg included); NixlConnector with one UCX thread"])
    targets = Table(key="vllm.targets", title="targets: vllm", columns=["target", "measured", "goal", "met"],
                    rows=[["kvplane TTFT p50 / NixlConnector TTFT p50 (vLLM, one run)", ratio(med["kvplane"], med["nixl"]), "<= 1.05x",
                           "YES" if r <= TARGET else "NO"]])
    return [detail, targets]
