"""vLLM's AMX attention needs the AMX tile state asked for in each engine
process (app/vllm/amx.py): kvplane's vLLM plugin asks; on a CPU without AMX
it changes nothing.  The job's engines keep vLLM off its AMX kernels."""
from __future__ import annotations

import platform
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from kvplane.app.vllm.amx import AMX_ENV, request_amx_state
from kvplane.app.vllm.engines import EngineSpec

REPO = Path(__file__).resolve().parent.parent


def _cpu_has_amx() -> bool:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return "amx_tile" in flags.split()


def test_the_plugin_is_registered_where_vllm_looks():
    plugins = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvplane_amx"]
    assert len(plugins) == 1, "reinstall kvplane (pip install -e .) to register its entry points"
    assert plugins[0].load() is request_amx_state


def test_a_fresh_process_gets_the_tile_state_only_where_the_cpu_has_amx():
    code = ("from kvplane.app.vllm.amx import amx_permitted, request_amx_state\n"
            "before = amx_permitted()\n"
            "print(before, request_amx_state(), request_amx_state(), amx_permitted())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout.split()
    amx = str(_cpu_has_amx())
    # Not inherited from this process (a new process starts without it), granted once asked, asked twice harmlessly.
    assert out == ["False", amx, amx, amx], out


def test_off_keeps_vllm_off_its_amx_kernels():
    """KVPLANE_VLLM_AMX=off (the job's engines): vLLM is told the CPU has
    no AMX, whatever it has, so its attention takes its AVX-512 path, whose
    bytes do not depend on the batch (the KV check compares bytes)."""
    pytest.importorskip("torch")
    code = ("import torch\n"
            "from kvplane.app.vllm.amx import amx_permitted, request_amx_state\n"
            "print(request_amx_state(), torch.cpu._is_amx_tile_supported(), amx_permitted())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "KVPLANE_VLLM_AMX": "off"}).stdout
    assert out.split() == ["False", "False", "False"], out


def test_the_jobs_engines_compute_the_same_bytes_whatever_the_batch():
    """In the job's engines' environment a bf16 linear layer (torch's, on
    oneDNN) gives each row the same bytes whatever else is in the batch: the
    KV check's premise.  (With AMX it did not, on the Xeon: 8 batch sizes of
    12 differed.)"""
    pytest.importorskip("torch")
    env = EngineSpec(name="D", engine_id="decode-0", http_port=8100, side_channel_port=5600,
                     connector="kvplane").env()
    assert env[AMX_ENV] == "off"
    code = ("import torch\n"
            "torch.manual_seed(0)\n"
            "w, x = torch.randn(1024, 512, dtype=torch.bfloat16), torch.randn(300, 512, dtype=torch.bfloat16)\n"
            "full = torch.nn.functional.linear(x, w)\n"
            "print(sum(not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m])\n"
            "          for m in (1, 2, 3, 7, 16, 17, 32, 33, 64, 100, 128, 200)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env=env).stdout
    assert out.split() == ["0"], out


def test_any_other_value_is_named_in_one_warning_and_changes_nothing():
    code = "from kvplane.app.vllm.amx import request_amx_state\nprint(request_amx_state())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", AMX_ENV: "of"})
    assert proc.stdout.split() == [str(_cpu_has_amx())], proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "KVPLANE_VLLM_AMX='of'" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
