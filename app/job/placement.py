"""Where an engine process of ``kvplane run`` talks to its peer: the UCX
devices its NIXL agent may use, the address its side channel binds, the
address it advertises to the peer, and (``--hosts netns``) the network
namespace it runs in.

The argparse types here validate the command line's placement options (a
bad value: one line on stderr, exit 2); ``enter`` applies a placement in a
freshly spawned engine process, before it imports NIXL or opens a socket.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import ipaddress
import os
import re
import socket

import attrs

from kvplane.transport.wire import host_problem

LOOPBACK = "127.0.0.1"
# The kernel's limit on an interface name (IFNAMSIZ - 1) and its characters.
_IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
# An RDMA device with its port, as UCX names it (mlx5_0:1).
_RDMA_DEVICE = re.compile(r"^[A-Za-z0-9_.-]{1,64}:[0-9]{1,3}$")
# setns(2) / unshare(2) / mount(2) flags (Python 3.11 has no os.setns).
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MNT_DETACH = 2
NETNS_DIR = "/run/netns"


@attrs.frozen(kw_only=True)
class Placement:
    """One engine's network placement (what its process applies at start)."""

    ucx_net_devices: str = "lo"  # UCX_NET_DEVICES
    ucx_tls: str | None = None  # UCX_TLS (None: UCX's own choice)
    side_channel_host: str = LOOPBACK  # the address the side channel binds
    advertise_host: str = LOOPBACK  # the address the peer is told (kv_transfer_params' remote_host)
    netns: str | None = None  # a network namespace under /run/netns to enter first

    def env(self) -> dict[str, str]:
        env = {"UCX_NET_DEVICES": self.ucx_net_devices}
        if self.ucx_tls is not None:
            env["UCX_TLS"] = self.ucx_tls
        return env


def enter(placement: Placement) -> None:
    """Apply ``placement`` to this process (and the processes it spawns
    later): enter its network namespace, set the UCX environment."""
    if placement.netns is not None:
        enter_netns(placement.netns)
    os.environ.update(placement.env())


def enter_netns(name: str) -> None:
    """Move this process into the named network namespace (``ip netns add``),
    as ``ip netns exec`` does: UCX finds its devices under /sys/class/net,
    and sysfs shows the namespace of whoever mounted it, so this process
    also gets a mount namespace of its own (its mounts private to it) with
    sysfs mounted again there."""
    libc = ctypes.CDLL(None, use_errno=True)

    def call(what: str, rc: int) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (network namespace {name}): {os.strerror(err)}")

    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        call("setns", libc.setns(fd, CLONE_NEWNET))
    finally:
        os.close(fd)
    call("unshare(CLONE_NEWNS)", libc.unshare(CLONE_NEWNS))
    # Nothing this process mounts or unmounts from here on reaches the host.
    call("mount --make-rslave /", libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None))
    call("umount /sys", libc.umount2(b"/sys", MNT_DETACH))
    call("mount sysfs", libc.mount(name.encode(), b"/sys", b"sysfs", 0, None))


# ------------------------------------------------------------ argparse types
def ucx_devices(text: str) -> str:
    """``--ucx-net-devices``: ``all``, or a comma-separated list of this
    host's network interfaces (eth0) and RDMA devices with a port (mlx5_0:1)."""
    if text == "all":
        return text
    names = text.split(",")
    local = {name for _, name in socket.if_nameindex()}
    for name in names:
        if _RDMA_DEVICE.match(name) and ":" in name:
            device = name.rsplit(":", 1)[0]
            if not os.path.isdir(f"/sys/class/infiniband/{device}"):
                raise argparse.ArgumentTypeError(f"no RDMA device {device!r} on this host")
            continue
        if not _IFNAME.match(name):
            raise argparse.ArgumentTypeError(f"{name[:40]!r} is not an interface name")
        if name not in local:
            raise argparse.ArgumentTypeError(
                f"no interface {name!r} on this host (have: {', '.join(sorted(local))})")
    return text


def bind_host(text: str) -> str:
    """``--side-channel-host``: an address of this host the side channel can
    bind (checked by binding it once)."""
    problem = host_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    family = socket.AF_INET6 if ":" in text else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((text.strip("[]"), 0))
    except OSError as exc:
        why = "not an address of this host" if exc.errno == errno.EADDRNOTAVAIL else exc.strerror
        raise argparse.ArgumentTypeError(f"cannot bind {text}: {why}") from None
    return text


def advertise_host(text: str) -> str:
    """``--advertise-host``: a host name or address peers can reach (not a
    wildcard: the peer connects to it)."""
    problem = host_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    try:
        if ipaddress.ip_address(text.strip("[]")).is_unspecified:
            raise argparse.ArgumentTypeError(f"{text} is a wildcard: advertise an address the peer can reach")
    except ValueError:
        pass  # a host name
    return text
