#!/usr/bin/env bash
# Run the VRAM READ + notification check on a machine with a GPU.
# Usage: bench/gpu_check.sh [MiB]   (default 256)
set -euo pipefail
cd "$(dirname "$0")/.."
# UCX picks its own transports for VRAM; only logging is quietened here.
export NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-ERROR}"
exec python bench/gpu_check.py "$@"
