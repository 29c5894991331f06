import os

# Must happen before anything imports NIXL/UCX: keep UCX on loopback and NIXL quiet.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
