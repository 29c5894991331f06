"""In-process fake of NixlEndpoint with deterministic, caller-driven faults.

Endpoints share a :class:`LoopbackFabric`.  Transfers copy torch tensors
between registered caches, span by span of the same descriptor plan the
NIXL endpoint posts (``descriptors.plan_transfer``), when they complete (after ``transfer_polls`` calls
to poll_transfer); notifications are queued per receiver and delivered by
poll_notifs.  Faults are armed on the fabric and consumed in order, so a test
states exactly which message or transfer misbehaves; nothing is random.
"""

from __future__ import annotations

import attrs
import msgpack
import torch

from .descriptors import TransferPlan, plan_slices, plan_transfer
from .errors import MetadataRejected, NotFound, PeerDisconnected, TransferFailed
from .handle import DONE, PROC, XferHandle
from .layout import WHOLE_BLOCK, BlockPart, CacheLayout, check_part

_MD_PREFIX = b"LOOPBACK1:"


@attrs.define
class _NotifRule:
    kind: str  # "drop" | "duplicate" | "delay" | "reverse"
    sender: str | None
    receiver: str | None
    prefix: bytes
    remaining: int
    polls: int = 0  # delay
    copies: int = 2  # duplicate

    def matches(self, sender: str, receiver: str, msg: bytes) -> bool:
        return (
            self.remaining > 0
            and (self.sender is None or self.sender == sender)
            and (self.receiver is None or self.receiver == receiver)
            and msg.startswith(self.prefix)
        )


@attrs.define
class _XferRule:
    kind: str  # "fail" | "hang"
    initiator: str | None
    remote: str | None
    remaining: int
    message: str = ""


@attrs.define
class _Pending:
    sender: str
    msg: bytes
    due_poll: int  # deliverable once the receiver's poll count reaches this


@attrs.define(eq=False)
class _Xfer:
    op: str
    initiator: str
    remote: str
    local_regions: list[torch.Tensor]  # flat byte views
    remote_regions: list[torch.Tensor]
    plan: TransferPlan
    notif: bytes
    polls_left: int
    fate: str = "ok"  # "ok" | "fail" | "hang"
    fail_message: str = ""
    state: str = PROC


class LoopbackFabric:
    """Shared medium: agent registry, notification queues, fault rules, clocks."""

    def __init__(self, *, transfer_polls: int = 1) -> None:
        if transfer_polls < 1:
            raise ValueError("transfer_polls must be >= 1")
        self.transfer_polls = transfer_polls
        self._agents: dict[str, LoopbackEndpoint] = {}
        self._dead: set[str] = set()
        self._queues: dict[str, list[_Pending]] = {}
        self._held: dict[int, list[tuple[str, str, bytes]]] = {}  # reverse-rule buffers
        self._notif_rules: list[_NotifRule] = []
        self._xfer_rules: list[_XferRule] = []
        self._clock_offsets: dict[str, float] = {}
        self.delivered: list[tuple[str, str, bytes]] = []  # (sender, receiver, msg) audit log

    # ---------------------------------------------------------------- faults

    def drop_notifs(self, *, sender=None, receiver=None, prefix: bytes = b"", count: int = 1) -> None:
        self._notif_rules.append(_NotifRule("drop", sender, receiver, prefix, count))

    def duplicate_notifs(
        self, *, sender=None, receiver=None, prefix: bytes = b"", count: int = 1, copies: int = 2
    ) -> None:
        if copies < 2:
            raise ValueError("copies must be >= 2")
        self._notif_rules.append(_NotifRule("duplicate", sender, receiver, prefix, count, copies=copies))

    def delay_notifs(
        self, *, polls: int, sender=None, receiver=None, prefix: bytes = b"", count: int = 1
    ) -> None:
        """Deliver matching notifs only on the receiver's ``polls``-th poll after sending."""
        if polls < 1:
            raise ValueError("polls must be >= 1")
        self._notif_rules.append(_NotifRule("delay", sender, receiver, prefix, count, polls=polls))

    def reverse_notifs(self, *, count: int, sender=None, receiver=None, prefix: bytes = b"") -> None:
        """Hold the next ``count`` matching notifs and release them in reverse order."""
        if count < 2:
            raise ValueError("reordering needs count >= 2")
        rule = _NotifRule("reverse", sender, receiver, prefix, count)
        self._notif_rules.append(rule)
        self._held[id(rule)] = []

    def fail_transfers(
        self, *, initiator=None, remote=None, count: int = 1, message: str = "injected failure"
    ) -> None:
        """The next ``count`` matching posted transfers end in TransferFailed."""
        self._xfer_rules.append(_XferRule("fail", initiator, remote, count, message))

    def hang_transfers(self, *, initiator=None, remote=None, count: int = 1) -> None:
        """The next ``count`` matching transfers stay PROC forever (a SIGSTOPped peer)."""
        self._xfer_rules.append(_XferRule("hang", initiator, remote, count))

    def kill(self, name: str) -> None:
        """The agent dies: its transfers fail with PeerDisconnected, its notifs stop."""
        if name not in self._agents:
            raise NotFound(f"no loopback agent {name!r}")
        self._dead.add(name)
        # Queued-but-undelivered messages from the dead agent vanish with it.
        for q in self._queues.values():
            q[:] = [p for p in q if p.sender != name]

    def is_dead(self, name: str) -> bool:
        return name in self._dead

    def set_clock_offset(self, name: str, offset: float) -> None:
        self._clock_offsets[name] = offset

    def clock_offset(self, name: str) -> float:
        return self._clock_offsets.get(name, 0.0)

    def clock(self, name: str, now: float) -> float:
        """What agent ``name``'s clock reads at true time ``now``."""
        return now + self.clock_offset(name)

    # ---------------------------------------------------------------- internals

    def _join(self, ep: "LoopbackEndpoint") -> None:
        if ep.name in self._agents:
            raise ValueError(f"agent name {ep.name!r} already on this fabric")
        self._agents[ep.name] = ep
        self._queues[ep.name] = []

    def _agent(self, name: str) -> "LoopbackEndpoint":
        try:
            return self._agents[name]
        except KeyError:
            raise NotFound(f"no loopback agent {name!r}") from None

    def _send(self, sender: str, receiver: str, msg: bytes) -> None:
        if sender in self._dead:
            return  # a dead agent sends nothing
        recv = self._agents[receiver]
        due = recv._polls + 1
        copies = 1
        for rule in self._notif_rules:
            if not rule.matches(sender, receiver, msg):
                continue
            rule.remaining -= 1
            if rule.kind == "drop":
                return
            if rule.kind == "duplicate":
                copies = rule.copies
            elif rule.kind == "delay":
                due = recv._polls + rule.polls
            elif rule.kind == "reverse":
                held = self._held[id(rule)]
                held.append((sender, receiver, msg))
                if rule.remaining == 0:
                    for s, r, m in reversed(held):
                        self._enqueue(s, r, m, self._agents[r]._polls + 1, 1)
                    held.clear()
                return
            break  # first matching rule wins
        self._enqueue(sender, receiver, msg, due, copies)

    def _enqueue(self, sender: str, receiver: str, msg: bytes, due: int, copies: int) -> None:
        for _ in range(copies):
            self._queues[receiver].append(_Pending(sender, msg, due))

    def _take(self, receiver: str, poll_no: int) -> list[tuple[str, bytes]]:
        q = self._queues[receiver]
        ready = [p for p in q if p.due_poll <= poll_no and p.sender not in self._dead]
        q[:] = [p for p in q if p.due_poll > poll_no and p.sender not in self._dead]
        out = [(p.sender, p.msg) for p in ready]
        self.delivered.extend((s, receiver, m) for s, m in out)
        return out

    def _fate(self, initiator: str, remote: str) -> tuple[str, str]:
        for rule in self._xfer_rules:
            if rule.remaining > 0 and rule.initiator in (None, initiator) and rule.remote in (None, remote):
                rule.remaining -= 1
                return rule.kind, rule.message
        return "ok", ""


class LoopbackEndpoint:
    """Same surface as NixlEndpoint, backed by a LoopbackFabric."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        if not name:
            raise ValueError("agent name must not be empty")
        self.fabric = fabric
        self.name = name
        self._regions: list[torch.Tensor] = []
        self._layout: CacheLayout | None = None
        self._remotes: set[str] = set()
        self._polls = 0
        self._closed = False
        fabric._join(self)

    # ------------------------------------------------------------ memory / peers

    def register_kv_cache(self, tensor: torch.Tensor, block_size_bytes: int) -> CacheLayout:
        self._check_alive()
        if not tensor.is_contiguous():
            raise ValueError("KV cache tensor must be contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        num_blocks = tensor.shape[0] if tensor.dim() else 0
        if num_blocks == 0 or block_size_bytes * num_blocks != nbytes:
            raise ValueError(
                f"block_size_bytes={block_size_bytes} x num_blocks={num_blocks} != tensor size {nbytes} B"
            )
        mem_type = "VRAM" if tensor.is_cuda else "DRAM"
        device_id = tensor.get_device() if tensor.is_cuda else 0
        if self._layout is None:
            layout = CacheLayout(mem_type, device_id, block_size_bytes, num_blocks, (tensor.data_ptr(),))
        else:
            old = self._layout
            if (old.mem_type, old.device_id, old.block_size, old.num_blocks) != (
                mem_type, device_id, block_size_bytes, num_blocks
            ):
                raise ValueError("region does not match the registered cache")
            layout = attrs.evolve(old, base_addrs=old.base_addrs + (tensor.data_ptr(),))
        # Flat byte view: copies by span are then dtype-agnostic.
        self._regions.append(tensor.view(torch.uint8).reshape(-1))
        self._layout = layout
        return layout

    def describe_cache(self) -> dict:
        if self._layout is None:
            raise RuntimeError("no KV cache registered")
        return self._layout.to_dict()

    def local_metadata(self) -> bytes:
        self._check_alive()
        return _MD_PREFIX + msgpack.packb({"name": self.name})

    def add_remote(self, metadata: bytes) -> str:
        self._check_alive()
        metadata = bytes(metadata)
        if not metadata.startswith(_MD_PREFIX):
            raise MetadataRejected("add_remote: not loopback metadata")
        try:
            name = msgpack.unpackb(metadata[len(_MD_PREFIX):])["name"]
        except Exception as e:
            raise MetadataRejected(f"add_remote: undecodable metadata: {e}") from e
        self.fabric._agent(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        if name not in self._remotes:
            raise NotFound(f"remote agent {name!r} not loaded")
        self._remotes.discard(name)

    def connect(self, remote_name: str) -> None:
        self._check_peer(remote_name, "connect")

    # ------------------------------------------------------------ transfers

    def post_read(self, remote_name, remote_desc, remote_block_ids, local_block_ids, notif=b"", *,
                  remote_part: BlockPart = WHOLE_BLOCK, local_part: BlockPart = WHOLE_BLOCK,
                  local_first_region: int | None = None) -> XferHandle:
        return self._post("READ", remote_name, remote_desc, remote_block_ids, local_block_ids, notif,
                          remote_part, local_part, local_first_region)

    def post_write(self, remote_name, remote_desc, remote_block_ids, local_block_ids, notif=b"", *,
                   remote_part: BlockPart = WHOLE_BLOCK, local_part: BlockPart = WHOLE_BLOCK,
                   local_first_region: int | None = None) -> XferHandle:
        return self._post("WRITE", remote_name, remote_desc, remote_block_ids, local_block_ids, notif,
                          remote_part, local_part, local_first_region)

    def _post(self, op, remote_name, remote_desc, remote_block_ids, local_block_ids, notif,
              remote_part, local_part, local_first_region=None) -> XferHandle:
        self._check_alive()
        remote_part = check_part(remote_part, "remote")
        local_part = check_part(local_part, "local")
        if self._layout is None:
            raise RuntimeError("register_kv_cache before posting transfers")
        remote_layout = CacheLayout.from_dict(remote_desc)
        slice_bytes = self._layout.check_pairable_parts(remote_layout, local_part, remote_part,
                                                          local_first_region)
        rids, lids = list(remote_block_ids), list(local_block_ids)
        if len(rids) != len(lids):
            raise ValueError(f"{len(rids)} remote blocks vs {len(lids)} local blocks")
        if not lids:
            raise ValueError("a transfer needs at least one block")
        self._layout.check_block_ids(lids, "local")
        remote_layout.check_block_ids(rids, "remote")
        plan = plan_transfer(self._layout, remote_layout, lids, rids, local_part, remote_part, slice_bytes,
                             local_first_region)
        return self._post_plan(op, remote_name, remote_layout, plan, len(lids), notif)

    def post_read_slices(self, remote_name, remote_desc, slices, notif=b"") -> XferHandle:
        return self._post_slices("READ", remote_name, remote_desc, slices, notif)

    def post_write_slices(self, remote_name, remote_desc, slices, notif=b"") -> XferHandle:
        return self._post_slices("WRITE", remote_name, remote_desc, slices, notif)

    def _post_slices(self, op, remote_name, remote_desc, slices, notif) -> XferHandle:
        self._check_alive()
        if self._layout is None:
            raise RuntimeError("register_kv_cache before posting transfers")
        remote_layout = CacheLayout.from_dict(remote_desc)
        plan = plan_slices(self._layout, remote_layout, list(slices))
        return self._post_plan(op, remote_name, remote_layout, plan, len({s.local_block for s in slices}), notif)

    def _post_plan(self, op, remote_name, remote_layout, plan, num_blocks, notif) -> XferHandle:
        self._check_peer(remote_name, f"post {op}")
        peer = self.fabric._agent(remote_name)
        if peer._layout is None or peer._layout.base_addrs != remote_layout.base_addrs:
            raise NotFound(f"{op}: remote descriptors are not registered on {remote_name!r}")
        fate, message = self.fabric._fate(self.name, remote_name)
        x = _Xfer(op, self.name, remote_name, self._regions, peer._regions, plan, bytes(notif),
                  self.fabric.transfer_polls, fate, message)
        return XferHandle(op, remote_name, bytes(notif), num_blocks, x, nbytes=plan.nbytes,
                          descriptors=plan.descriptors)

    def poll_transfer(self, handle: XferHandle) -> str:
        self._check_alive()
        if handle.released:
            raise NotFound(f"transfer {handle.id} was already released")
        x: _Xfer = handle.raw
        if x.state == DONE:
            return DONE
        if self.fabric.is_dead(x.remote):
            raise PeerDisconnected(f"{x.op} {handle.id}: remote agent {x.remote!r} disconnected")
        if x.fate == "hang":
            return PROC
        x.polls_left -= 1
        if x.polls_left > 0:
            return PROC
        if x.fate == "fail":
            raise TransferFailed(f"{x.op} {handle.id} to {x.remote!r} failed: {x.fail_message}")
        src, dst = (x.remote_regions, x.local_regions) if x.op == "READ" else (x.local_regions, x.remote_regions)
        sspans, dspans = (x.plan.remote, x.plan.local) if x.op == "READ" else (x.plan.local, x.plan.remote)
        for s, d in zip(sspans, dspans):
            dst[d.region][d.offset:d.offset + d.length] = src[s.region][s.offset:s.offset + s.length]
        x.state = DONE
        if x.notif:
            self.fabric._send(self.name, x.remote, x.notif)
        return DONE

    def release(self, handle: XferHandle, *, missing_ok: bool = False) -> None:
        if handle.released:
            if missing_ok:
                return
            raise NotFound(f"transfer {handle.id} was already released")
        handle.released = True

    # ------------------------------------------------------------ notifications

    def send_notif(self, remote_name: str, msg: bytes) -> None:
        self._check_alive()
        self._check_peer(remote_name, "send_notif")
        self.fabric._send(self.name, remote_name, bytes(msg))

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        self._check_alive()
        self._polls += 1
        return self.fabric._take(self.name, self._polls)

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "LoopbackEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError(f"endpoint {self.name!r} is closed")
        if self.fabric.is_dead(self.name):
            raise PeerDisconnected(f"local agent {self.name!r} was killed")

    def _check_peer(self, remote_name: str, what: str) -> None:
        if remote_name not in self._remotes:
            raise NotFound(f"{what}: unknown remote agent {remote_name!r} (add_remote first)")
        if self.fabric.is_dead(remote_name):
            raise PeerDisconnected(f"{what}: remote agent {remote_name!r} disconnected")
