"""``kvplane run --hosts netns``: each engine in a network namespace of its
own, as hosts on one switch: a bridge in a namespace of its own, and one
veth pair from each host to it.

``HostNet`` creates the namespaces, the veth pairs and the hosts'
addresses (a /24 of 10.213.0.0/16 picked from the run's pid; it exists
only inside the namespaces, nothing in the root namespace is routed), and removes them
on every way out: the ``with`` block's end (an exception, a failed check,
Ctrl-C), SIGTERM and SIGHUP (turned into ``SystemExit`` so the block
unwinds), and ``atexit``.  Deleting a namespace deletes its ends of the
veths, and with them the pairs.  Names carry the run's pid, so concurrent
runs do not collide; at start a run removes what a run whose process is
gone left behind (a SIGKILLed parent cannot clean up after itself).

``reach_from_root`` (the vLLM job: its proxy and health checks talk HTTP
to the engines) adds one more veth, from the root namespace to the switch,
with the subnet's .254: the root namespace then routes that /24 only, and
the veth goes with the switch's namespace.

Faults: ``partition`` (every prefill engine's link down on both ends: each
P cut from every decoder) and ``heal``, and ``rate_limit`` (a tbf qdisc on every host's
veth; netem, for delay and loss, is not in every kernel).
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from typing import Any

import attrs

from .placement import NETNS_DIR, Placement

PREFIX = "kvplane-"
NET = ipaddress.IPv4Network("10.213.0.0/16")
# ``kvplane-<pid>-<role>``: a namespace of this module's making.
_OURS = re.compile(r"^kvplane-(\d+)-[a-z0-9]+$")
# An ``ip`` or ``tc`` call that takes longer than this is stuck.
CALL_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, a kernel without them)."""


@attrs.frozen
class Host:
    """One side of the pair: its namespace, its end of the veth, its address."""

    role: str
    netns: str
    veth: str
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsUnavailable(f"{' '.join(args)}: {exc}") from None
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def namespaces() -> list[str]:
    """The names ``ip netns list`` shows."""
    out = _ip("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(pid: int | None = None) -> list[str]:
    """Delete the namespaces of ours that a run left behind: this pid's (a
    reused pid) and those of runs whose process is gone.  Returns them."""
    gone = []
    for name in namespaces():
        m = _OURS.match(name)
        if m is None:
            continue
        owner = int(m.group(1))
        if owner == pid or not _pid_alive(owner):
            _ip("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


def subnet_for(pid: int) -> ipaddress.IPv4Network:
    """A /24 of ``NET`` for this run (the hosts are .1, .2, ...)."""
    return list(NET.subnets(new_prefix=24))[pid % 256]


class HostNet:
    """The hosts' namespaces on a switch; a context manager (see the module docstring)."""

    def __init__(self, pid: int | None = None, roles: tuple[str, ...] = ("P", "D")):
        self.pid = os.getpid() if pid is None else pid
        net = subnet_for(self.pid)
        self.prefix_len = net.prefixlen
        self.switch = f"{PREFIX}{self.pid}-net"
        self.hosts = {role: Host(role=role, netns=f"{PREFIX}{self.pid}-{role.lower()}",
                                 veth=f"kvp{self.pid % 10**7}{role.lower()}", address=str(net.network_address + i))
                      for i, role in enumerate(roles, start=1)}
        self.root_veth = f"kvp{self.pid % 10**7}r"
        self.root_address: str | None = None  # set by reach_from_root
        self._net = net
        self.up = False
        self.partitioned = False
        self.rate_bits: int | None = None
        self._old_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "HostNet":
        check_available()
        remove_leftovers(self.pid)
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _exit_on_signal)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        self.up = True
        for name in (self.switch, *(h.netns for h in self.hosts.values())):
            _ip("ip", "netns", "add", name)
        sw = self.switch
        _ip("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", sw, "link", "set", "br0", "up")
        for h in self.hosts.values():
            port = _port(h)
            _ip("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", h.veth, "netns", h.netns)
            _ip("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            _ip("ip", "-n", h.netns, "link", "set", "lo", "up")
            _ip("ip", "-n", h.netns, "addr", "add", f"{h.address}/{self.prefix_len}", "dev", h.veth)
            _ip("ip", "-n", h.netns, "link", "set", h.veth, "up")

    def reach_from_root(self) -> str:
        """A veth from the root namespace to the switch, with the subnet's
        .254: this process reaches the hosts' addresses (HTTP to engines in
        the namespaces).  Returns that address."""
        address = str(self._net.network_address + 254)
        _ip("ip", "link", "add", self.root_veth, "type", "veth", "peer", "name", "sw-root", "netns", self.switch)
        self.root_address = address
        _ip("ip", "-n", self.switch, "link", "set", "sw-root", "master", "br0", "up")
        _ip("ip", "addr", "add", f"{address}/{self.prefix_len}", "dev", self.root_veth)
        _ip("ip", "link", "set", self.root_veth, "up")
        return address

    def close(self) -> None:
        """Remove every namespace (and so the veth pairs); idempotent."""
        if self.up:
            for name in (*(h.netns for h in self.hosts.values()), self.switch):
                _ip("ip", "netns", "del", name, check=False)
            if self.root_address is not None:  # gone with the switch; in case its peer never got there
                _ip("ip", "link", "del", self.root_veth, check=False)
                self.root_address = None
            self.up = False
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old_handlers.clear()
        atexit.unregister(self.close)

    # ------------------------------------------------------------ placement
    def placement(self, role: str) -> Placement:
        """Where ``role``'s engine runs: its namespace, UCX over TCP on its veth,
        its side channel on its veth address."""
        h = self.hosts[role]
        return Placement(ucx_net_devices=h.veth, ucx_tls="tcp", side_channel_host=h.address,
                         advertise_host=h.address, netns=h.netns)

    # ------------------------------------------------------------ faults
    def prefill_hosts(self) -> list[Host]:
        """Every prefill engine's host (roles P, P1, ...)."""
        return [h for role, h in self.hosts.items() if role.startswith("P")]

    def partition(self) -> None:
        """Cut every prefill engine's link: both ends down (the addresses
        stay; routes go), so no P reaches any D."""
        for p in self.prefill_hosts():
            _ip("ip", "-n", p.netns, "link", "set", p.veth, "down")
            _ip("ip", "-n", self.switch, "link", "set", _port(p), "down")
        self.partitioned = True

    def heal(self) -> None:
        for p in self.prefill_hosts():
            _ip("ip", "-n", self.switch, "link", "set", _port(p), "up")
            _ip("ip", "-n", p.netns, "link", "set", p.veth, "up")
        self.partitioned = False

    def rate_limit(self, bits_per_s: int) -> None:
        """Shape every host's veth to ``bits_per_s`` (tbf; its bucket holds 10 ms of
        traffic, at least 64 KiB, and a packet waits at most 200 ms)."""
        burst = max(64 * 1024, bits_per_s // 8 // 100)
        for h in self.hosts.values():
            _ip("ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", h.veth, "root", "tbf",
                "rate", f"{bits_per_s}bit", "burst", str(burst), "latency", "200ms")
        self.rate_bits = bits_per_s


def _port(h: Host) -> str:
    """The switch's end of a host's veth."""
    return f"sw-{h.role.lower()}"


def check_available() -> None:
    """Raise ``NetnsUnavailable`` with one clear line unless this process can
    make namespaces (root, ``ip`` and ``tc`` installed)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"--hosts netns needs {' and '.join(missing)} (iproute2)")
    if os.geteuid() != 0:
        raise NetnsUnavailable("--hosts netns needs root (it creates network namespaces and a veth pair)")
    os.makedirs(NETNS_DIR, exist_ok=True)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    """SIGTERM / SIGHUP: unwind like Ctrl-C, so every ``finally`` and
    ``with`` cleans up (the engines, then the namespaces)."""
    raise SystemExit(128 + signum)
