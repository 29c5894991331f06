"""What a vLLM engine's ``kv_transfer_config`` tells the connector.

The keys of ``kv_connector_extra_config`` and their defaults are
NixlConnector's, so a deployment switches connectors by changing the
class name only: ``kv_lease_duration`` (30 s; heartbeats every
lease // 6, each extending the lease by lease * 2 // 3),
``decoder_kv_blocks_ttl`` (480 s), ``bidirectional_kv_xfer`` (False),
``engine_ttl`` (3600 s), ``enforce_handshake_compat`` (True),
``kv_recompute_threshold`` (64 tokens: a turn-2 read of fewer is computed),
``push_registration_timeout``; ``kv_load_failure_policy`` is vLLM's
top-level key (default "fail").  The other PlaneConfig fields may be set
the same way.  kvplane's own keys start with ``kvplane_`` (authentication,
event log, status file, fault injection); every one is optional.

This module imports no vLLM: it reads plain values.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

import attrs

from kvplane.statemachines.config import ConfigError, PlaneConfig
from kvplane.transport.wire import host_problem
from kvplane.statemachines.tp_mapping import MAX_TP

from .secret import SECRET_ENV, SECRET_KEY, DeploymentKeys, load_keys

# NixlConnector's defaults where PlaneConfig's differ (PlaneConfig is tuned
# for the main job, where engines come and go in seconds).
# The handshake timeout is vLLM's VLLM_P2P_HANDSHAKE_TIMEOUT_S: a busy worker
# answers its side channel late, and 5 s failed handshakes on a loaded box.
VLLM_DEFAULTS = {"engine_ttl": 3600.0, "kv_load_failure_policy": "fail", "handshake_timeout": 30.0}
# NixlConnector keys that are not PlaneConfig fields.
NIXL_KEYS = ("bidirectional_kv_xfer", "enforce_handshake_compat", "kv_recompute_threshold", "backends", "num_threads")
# NixlConnector 0.32.0's kv_recompute_threshold default (tokens).
KV_RECOMPUTE_THRESHOLD = 64
# NIXL backends that move memory between two engines' agents (the rest are
# storage: GDS, POSIX, OBJ, ...).  A list without one of them cannot read a
# remote engine's blocks, so it is refused at start-up, not at the first read.
NIXL_TRANSFER_BACKENDS = ("UCX", "LIBFABRIC", "UCCL", "MOONCAKE")
MAX_NIXL_THREADS = 64
COMPAT_HASH = "kvplane-vllm-v1"
# UCX_NET_DEVICES: "all", or a comma-separated list of interfaces and RDMA devices with a port.
_UCX_DEVICES = re.compile(r"^(all|[A-Za-z0-9_.-]{1,64}(:[0-9]{1,3})?(,[A-Za-z0-9_.-]{1,64}(:[0-9]{1,3})?)*)$")


@attrs.frozen(kw_only=True)
class VllmSettings:
    plane: PlaneConfig
    bidirectional: bool = False
    # kv_recompute_threshold: P computes a turn-2 read of fewer tokens of D's
    # hold than this and tells D to free it at once; 0 reads every one.  As
    # NixlConnector 0.32.0, only a turn-2 read (P reading D's hold) is
    # skipped: D's reads of P's prefill are always made.
    kv_recompute_threshold: int = KV_RECOMPUTE_THRESHOLD
    enforce_handshake_compat: bool = True
    # kvplane_side_channel_port: rank r of data-parallel index i listens on
    # port + i * tp_size + r (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT by default).
    side_channel_port: int = 5600
    side_channel_host: str = "127.0.0.1"  # the address peers are told (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST)
    # kvplane_side_channel_bind_host: the address the side channel binds, where
    # peers reach this host through another (0.0.0.0, a NAT); None: side_channel_host.
    side_channel_bind_host: str | None = None
    # kvplane_ucx_net_devices: UCX_NET_DEVICES for the worker's NIXL agent (eth0,
    # mlx5_0:1, all); None: the environment's (UCX's default: every device).
    ucx_net_devices: str | None = None
    # backends / num_threads (NixlConnector's keys): the NIXL agent's backend
    # list and its backends' worker threads.  kvplane's default is 0 threads,
    # not NixlConnector's 4: its agent is polled by the connector (no progress
    # thread), and on a CPU engine every extra thread competes with the model.
    nixl_backends: tuple[str, ...] = ("UCX",)
    nixl_num_threads: int = 0
    # kvplane_secret_file (or env KVPLANE_SECRET_FILE): the deployment
    # secret (connector/secret.py): P signs its params with it, D verifies
    # them, and every engine's side channel uses its CURVE keypair.
    secret_file: str | None = None
    keys: DeploymentKeys | None = None
    # kvplane_keypair: a zmq.auth secret certificate (the engine's CURVE key);
    # kvplane_trusted_peers: engine id -> public certificate path or z85 key.
    # (Per-engine keys, no params authentication; the secret replaces both.)
    keypair_path: str | None = None
    trusted_peers: Mapping[str, str] = attrs.field(factory=dict)
    # kvplane_insecure: true runs with neither: plaintext side channel,
    # notifications from any agent, params unauthenticated (as with
    # NixlConnector).  Required to start without a secret or keypair.
    allow_insecure: bool = False
    # kvplane_event_log: JSONL path; kvplane_status_file: JSON written every
    # step.  "{rank}" is replaced by the TP rank, "{dp}" by the engine core's
    # data-parallel index (for_dp_rank).
    event_log: str | None = None
    status_file: str | None = None
    kv_dump_dir: str | None = None  # kvplane_kv_dump_dir: where requests tagged kvplane_dump_kv save their KV
    # kvplane_reader_tp: the TP of the engines that read this engine's blocks
    # (D's for a prefill engine, P's for a decoder's holds); None: this
    # engine's own.  A lease awaits every reader rank that reads it, and vLLM's
    # P learns nothing of D's TP before D's completions arrive.
    reader_tp: int | None = None
    # kvplane_remote_block_size: the --block-size (tokens) of the engine whose
    # blocks this one reads (P's, on D), where it differs from this engine's:
    # P's params name P's blocks.  None: this engine's own.
    remote_block_size: int | None = None
    drop_notifications: float = 0.0  # kvplane_drop_notifications: fault injection, fraction dropped
    fault_seed: int = 0
    unknown_keys: tuple[str, ...] = ()

    @property
    def bind_host(self) -> str:
        return self.side_channel_bind_host or self.side_channel_host

    @property
    def insecure(self) -> bool:
        """No CURVE on the side channel (kvplane_insecure: true)."""
        return self.keys is None and self.keypair_path is None

    def rank_path(self, template: str | None, rank: int) -> str | None:
        return None if template is None else template.replace("{rank}", str(rank))


_OWN = {
    "kvplane_side_channel_port": "side_channel_port",
    "kvplane_side_channel_host": "side_channel_host",
    "kvplane_secret_file": "secret_file",
    "kvplane_insecure": "allow_insecure",
    "kvplane_side_channel_bind_host": "side_channel_bind_host",
    "kvplane_ucx_net_devices": "ucx_net_devices",
    "kvplane_keypair": "keypair_path",
    "kvplane_trusted_peers": "trusted_peers",
    "kvplane_event_log": "event_log",
    "kvplane_status_file": "status_file",
    "kvplane_kv_dump_dir": "kv_dump_dir",
    "kvplane_drop_notifications": "drop_notifications",
    "kvplane_reader_tp": "reader_tp",
    "kvplane_remote_block_size": "remote_block_size",
    "kvplane_fault_seed": "fault_seed",
}


def settings_from(extra: Mapping[str, Any] | None, *, kv_load_failure_policy: str | None = None,
                  side_channel_port: int = 5600, side_channel_host: str = "127.0.0.1",
                  environ: Mapping[str, str] | None = None) -> VllmSettings:
    """Settings from ``kv_connector_extra_config`` (and vLLM's top-level
    ``kv_load_failure_policy``; ``environ``, default ``os.environ``, for
    ``KVPLANE_SECRET_FILE``); a wrong value raises ``ConfigError`` naming
    the key.  Without a secret or a keypair, ``kvplane_insecure: true`` is
    required."""
    environ = os.environ if environ is None else environ
    extra = dict(extra or {})
    if not all(isinstance(k, str) for k in extra):
        raise ConfigError("kv_connector_extra_config", "keys must be strings")
    plane_fields = {f.name for f in attrs.fields(PlaneConfig)}
    plane_values: dict[str, Any] = {k: v for k, v in VLLM_DEFAULTS.items()}
    if kv_load_failure_policy is not None:
        plane_values["kv_load_failure_policy"] = kv_load_failure_policy
    own: dict[str, Any] = {"side_channel_port": side_channel_port, "side_channel_host": side_channel_host}
    unknown = []
    for key, value in extra.items():
        if key in plane_fields:
            plane_values[key] = value
        elif key in _OWN:
            own[_OWN[key]] = value
        elif key == "bidirectional_kv_xfer":
            own["bidirectional"] = _bool(key, value)
        elif key == "enforce_handshake_compat":
            own["enforce_handshake_compat"] = _bool(key, value)
        elif key == "kv_recompute_threshold":
            own["kv_recompute_threshold"] = _int_in(key, value, 0, None, "a token count >= 0")
        elif key == "backends":
            own["nixl_backends"] = _backends(value)
        elif key == "num_threads":
            own["nixl_num_threads"] = _int_in(key, value, 0, MAX_NIXL_THREADS, f"a thread count in 0..{MAX_NIXL_THREADS}")
        elif key not in NIXL_KEYS:
            unknown.append(key)
    plane = PlaneConfig(**plane_values)
    _check_port("kvplane_side_channel_port", own["side_channel_port"])
    if not isinstance(own["side_channel_host"], str) or not own["side_channel_host"]:
        raise ConfigError("kvplane_side_channel_host", "must be a host name or address")
    bind = own.get("side_channel_bind_host")
    if bind is not None and (not isinstance(bind, str) or host_problem(bind) is not None):
        raise ConfigError("kvplane_side_channel_bind_host", f"must be an address of this host, got {bind!r}")
    devices = own.get("ucx_net_devices")
    if devices is not None and (not isinstance(devices, str) or not _UCX_DEVICES.match(devices)):
        raise ConfigError("kvplane_ucx_net_devices", f"must be UCX_NET_DEVICES (eth0,mlx5_0:1 or all), got {devices!r}")
    for key in ("secret_file", "keypair_path", "event_log", "status_file", "kv_dump_dir"):
        value = own.get(key)
        if value is not None and not isinstance(value, (str, Path)):
            raise ConfigError(_key_of(key), f"must be a path, got {type(value).__name__}")
        if value is not None:
            own[key] = str(value)
    peers = own.get("trusted_peers", {})
    if not isinstance(peers, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in peers.items()):
        raise ConfigError("kvplane_trusted_peers", "must map engine ids to a certificate path or z85 key")
    own["trusted_peers"] = dict(peers)
    rate = own.get("drop_notifications", 0.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or not 0 <= rate <= 1:
        raise ConfigError("kvplane_drop_notifications", f"must be a fraction in 0..1, got {rate!r}")
    reader_tp = own.get("reader_tp")
    if reader_tp is not None:
        _int_in("kvplane_reader_tp", reader_tp, 1, MAX_TP, f"a TP size in 1..{MAX_TP}")
    remote_block = own.get("remote_block_size")
    if remote_block is not None:
        _int_in("kvplane_remote_block_size", remote_block, 1, 1 << 16, "a block size in tokens")
    seed = own.get("fault_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError("kvplane_fault_seed", f"must be an int, got {seed!r}")
    own["allow_insecure"] = _bool("kvplane_insecure", own.get("allow_insecure", False))
    if own.get("secret_file") is None and environ.get(SECRET_ENV):
        own["secret_file"] = environ[SECRET_ENV]
    if own.get("secret_file") is not None:
        if own.get("keypair_path") is not None:
            raise ConfigError("kvplane_keypair", "give either kvplane_secret_file (one secret for the deployment) "
                                                 "or kvplane_keypair, not both")
        if own["allow_insecure"]:
            raise ConfigError("kvplane_insecure", "true contradicts the deployment secret "
                                                  f"({SECRET_KEY} or {SECRET_ENV})")
        own["keys"] = load_keys(own["secret_file"])
    elif own.get("keypair_path") is None:
        if peers:
            raise ConfigError("kvplane_trusted_peers", "needs kvplane_keypair (this engine's own CURVE key)")
        if not own["allow_insecure"]:
            raise ConfigError(SECRET_KEY, f"no deployment secret: set {SECRET_KEY} in kv_connector_extra_config "
                                          f"(or the environment variable {SECRET_ENV}) to a file holding one "
                                          "(python -c 'import secrets; print(secrets.token_hex(32))'), the same "
                                          "for every engine; or set kvplane_insecure: true to run unauthenticated "
                                          "(docs/security.md)")
    return VllmSettings(plane=plane, unknown_keys=tuple(sorted(unknown)), **own)


DP_FIELD = "{dp}"


def for_dp_rank(settings: VllmSettings, dp_index: int) -> VllmSettings:
    """``settings`` for the engine core of data-parallel index ``dp_index``:
    ``{dp}`` in the event log and status file names replaced by it.  vLLM
    runs a dense model's DP ranks as independent engine cores that share
    kv_connector_extra_config and tell a connector its DP index, never the DP
    size; so a name without ``{dp}`` is refused on a core of index > 0, where
    it would be the same file as index 0's (ConfigError)."""
    named = {}
    for field in ("event_log", "status_file"):
        template = getattr(settings, field)
        if template is None:
            continue
        if DP_FIELD not in template and dp_index > 0:
            raise ConfigError(_key_of(field), f"{template!r} has no {DP_FIELD} field, but this engine core is "
                                              f"data-parallel rank {dp_index}: every DP rank would write that file")
        named[field] = template.replace(DP_FIELD, str(dp_index))
    return attrs.evolve(settings, **named)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _backends(value: Any) -> tuple[str, ...]:
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(b, str) and b.isidentifier() for b in value) or len(set(value)) != len(value)):
        raise ConfigError("backends", f"must be a list of NIXL backend names, each once, got {value!r}")
    if not any(b.upper() in NIXL_TRANSFER_BACKENDS for b in value):
        raise ConfigError("backends", f"must name a backend that moves memory between engines "
                                      f"({', '.join(NIXL_TRANSFER_BACKENDS)}), got {list(value)!r}")
    return tuple(value)


def _int_in(key: str, value: Any, low: int, high: int | None, what: str) -> int:
    """``value`` if it is an int (not a bool) in ``low..high`` (None: no
    bound), else ConfigError naming ``key``: "must be <what>"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ConfigError(key, f"must be {what}, got {value!r}")
    return value


def _check_port(key: str, value: Any) -> None:
    _int_in(key, value, 1, 65535, "a port in 1..65535")


def _key_of(field: str) -> str:
    return next(k for k, f in _OWN.items() if f == field)
