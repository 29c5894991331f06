"""Stopping an engine process never raises: a process group that outlives its
SIGKILL's 30 s wait (a starved box) is reported, and the caller goes on to
stop the next engine (``VllmRun.stop``); before, the TimeoutExpired ended the
job with a traceback and left D's engine running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import attrs

from kvplane.app.vllm.engines import EngineProcess


@attrs.frozen
class SleeperSpec:
    """The parts of an EngineSpec that EngineProcess uses, for a process that ignores SIGINT."""

    name: str = "P"
    host: str = "127.0.0.1"
    http_port: int = 1

    def command(self, model_dir) -> list[str]:
        return [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); "
                                 "time.sleep(60)"]

    def env(self) -> dict[str, str]:
        return dict(os.environ)


def test_a_stop_whose_kill_is_not_reaped_in_time_returns_instead_of_raising(tmp_path, monkeypatch, capsys):
    engine = EngineProcess(SleeperSpec(), tmp_path, tmp_path / "p.log")
    real_wait = engine.proc.wait

    def never_in_time(timeout=None):
        raise subprocess.TimeoutExpired(engine.proc.args, timeout)

    monkeypatch.setattr(engine.proc, "wait", never_in_time)
    try:
        assert engine.stop(timeout=0.1) is None
        assert "still there 30 s after SIGKILL" in capsys.readouterr().err
    finally:
        monkeypatch.setattr(engine.proc, "wait", real_wait)
        try:
            os.killpg(engine.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        engine.proc.wait(timeout=30)


def test_a_stop_that_ignores_sigint_is_killed_after_the_timeout(tmp_path):
    engine = EngineProcess(SleeperSpec(), tmp_path, tmp_path / "p.log")
    deadline = time.monotonic() + 60
    while "ready" not in (tmp_path / "p.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stop(timeout=0.5) == -signal.SIGKILL
    assert not engine.alive
