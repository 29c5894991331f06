"""bench.connector's options and report (no engine is started here; the vllm-marked
test_bench_connector_vllm.py runs the smallest real configuration)."""
import threading
import time

import pytest

from bench import connector as C
from bench.report import is_targets


def test_options_defaults_and_refusals(capsys):
    o = C.options([])
    assert o.levels == (8, 64, 256) and o.requests == {8: 16, 64: 64, 256: 256} and o.serve
    assert o.json_path is None and not o.keep and o.pause_idle
    o = C.options(["--concurrency", "4", "16", "--requests", "5", "6", "--no-serve", "--keep", "--no-pause"])
    assert o.requests == {4: 5, 16: 6} and not o.serve and o.keep and not o.pause_idle
    assert C.options(["--concurrency", "12"]).requests == {12: 48}  # 4x the concurrency outside the table
    for bad in (["--concurrency", "0"], ["--concurrency", "x"], ["--concurrency", "8", "8"],
                ["--concurrency", "8", "64", "--requests", "3"], ["--idle", "0"], ["--idle", "nan"]):
        with pytest.raises(SystemExit) as exc:
            C.options(bad)
        assert exc.value.code == 2
        assert "python -m bench.connector: error:" in capsys.readouterr().err  # one line, no traceback


def test_paused_stops_a_process_tree_and_continues_it():
    """The pair that is not serving is stopped during a phase (SIGSTOP) and
    continued after it, even when the phase raises."""
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil", reason="psutil comes with vLLM: run scripts/install-vllm")
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])

    class Engine:
        proc = child

    def stopped(want: bool) -> bool:  # a signal is delivered asynchronously
        end = time.monotonic() + 10.0
        while (psutil.Process(child.pid).status() == psutil.STATUS_STOPPED) != want:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    try:
        with pytest.raises(RuntimeError):
            with C.paused({"P": Engine()}):
                assert stopped(True)
                raise RuntimeError("the phase failed")
        assert stopped(False)
        with C.paused(None):  # --no-pause
            time.sleep(0.1)
            assert stopped(False)
    finally:
        child.kill()
        child.wait()


def test_step_figures_keep_the_phase_window():
    steps = [{"t": 10.0 + i, "s": i * 1e-6, "m": {"start_load_kv": i * 1e-6}} for i in range(1, 101)]
    steps.append({"t": 500.0, "s": 1.0, "m": {"get_finished": 1.0}})  # outside the window
    f = C.step_figures(steps, 10.0, 111.0)
    assert f["steps"] == 100 and f["p50"] == pytest.approx(50, abs=1) and f["p99"] == pytest.approx(99, abs=1)
    assert f["top"] == "start_load_kv" and f["top_share"] == 1.0
    assert f["methods_ms"] == {"start_load_kv": pytest.approx(sum(range(1, 101)) * 1e-3)}
    empty = C.step_figures(steps, 0.0, 1.0)
    assert empty["steps"] == 0 and empty["top"] == "-"
    assert C.percentile([], 50) != C.percentile([], 50)  # NaN


def test_read_steps_sums_the_scheduler_and_worker_lines_of_one_step(tmp_path):
    import json

    sched = [{"t": 1.0 + i, "s": 1e-5, "m": {"build_connector_meta": 1e-5}} for i in range(3)]
    work = [{"t": 1.5 + i, "s": 2e-5, "m": {"start_load_kv": 2e-5}} for i in range(2)]  # stopped a step early
    (tmp_path / "steps.10.jsonl").write_text("\n".join(map(json.dumps, sched)) + "\n")
    (tmp_path / "steps.11.jsonl").write_text("\n".join(map(json.dumps, work)) + "\n{cut")
    steps = C.read_steps(tmp_path)
    assert [s["t"] for s in steps] == [1.0, 2.0]
    assert steps[0]["s"] == pytest.approx(3e-5) and set(steps[0]["m"]) == {"build_connector_meta", "start_load_kv"}


def test_thread_cpu_reads_a_live_thread():
    import os

    assert C.thread_cpu_s(os.getpid(), threading.get_native_id()) > 0


def _result(kvplane_p50: float, nixl_p50: float, idle: float) -> dict:
    def fig(p50: float) -> dict:
        return {"steps": 10, "p50": p50, "p99": 2 * p50, "mean": p50, "total_ms": p50 / 100, "top": "get_finished",
                "top_share": 0.5}

    phases = [{"connector": c, "concurrency": 8, "started": 0.0, "ended": 2.0, "ttft_s": (0.1, 0.2), "failed": 0,
               "ticker_cpu_s": {"P": 0.02, "D": 0.04} if c == "kvplane" else {},
               "pair_cpu_s": {"kvplane": 1.5, "nixl": 0.25}} for c in C.CONNECTORS]
    return {"startup_s": 100.0, "idle_s": 10.0, "idle_ticker": {"P": idle, "D": idle},
            "tickers_found": {"P": 1, "D": 1}, "phases": phases,
            "steps": {f"{c}-{n}": [fig(kvplane_p50 if c == "kvplane" else nixl_p50)]
                      for c in C.CONNECTORS for n in ("P", "D")},
            "serve": {"kvplane": {"completed": 64, "failed": 0, "median_ttft_ms": 30.0, "p99_ttft_ms": 90.0,
                                  "median_tpot_ms": 5.0, "p99_tpot_ms": 9.0},
                      "nixl": {"error": "vllm bench serve exited with 1"}}}


def test_tables_side_by_side_with_targets():
    out = C.tables(_result(50.0, 100.0, 0.002), "python -m bench connector")
    side, load, serve, goals = out
    assert side.rows[0][:6] == ["P", 8, "10 / 10", "50.0", "100", "0.50x"]
    assert side.rows[0][10] == "0.25 / 0.5"  # 0.5 and 1.0 ms over 2 answered requests each
    assert "command: python -m bench connector" in side.notes[-1]
    assert load.rows[0][-2] == "1.0% / 2.0%" and load.rows[1][-2] == "-"
    assert load.rows[0][-1] == "1.5 / 0.2" and load.rows[1][-1] == "0.2 / 1.5"  # this pair / the idle one
    assert "0.20%" in load.notes[1]
    assert serve.rows[1][:4] == ["nixl", "-", "-", "vllm bench serve exited with 1"]
    assert "no headline" in serve.notes[0]
    assert is_targets(goals) and all(r[-1] == "YES" for r in goals.rows)
    slower = C.tables(_result(150.0, 100.0, 0.05), "x")[-1]
    assert [r[-1] for r in slower.rows] == ["NO"] * len(slower.rows)
