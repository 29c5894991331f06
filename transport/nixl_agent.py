"""NixlEndpoint: one real NIXL agent, polled by its owner (no progress thread).

The default NIXL progress thread busy-spins (~0.7 core per agent), so the agent
is created with ``enable_prog_thread=False``; every side, including a purely
passive one, must call :meth:`poll_notifs` / :meth:`poll_transfer` (or
:meth:`progress`) from its loop.  Measured with nixl 1.5.1 over UCX here: a
READ carrying a notification, or posted after one was sent to the same peer
(heartbeats, completions: always, in a running plane), completes only when
its target progresses, so how often the passive side polls bounds the
reader's latency (a target polling every 1 ms: ~1.1 ms for any READ; every
0.1 ms: 0.2 ms for 1 MiB).

A transfer is made from indices into prepared descriptor lists
(``prepped.py``: the local cache's once, each remote's once per incarnation;
NIXL merges contiguous runs); a cache too large to prepare, or an endpoint
made with ``prepped=False``, builds each transfer's lists from
``descriptors.plan_transfer`` instead.  Each transfer's time from post to the
poll that saw it done is kept in :attr:`NixlEndpoint.transfer_times`.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, Sequence

# Quiet NIXL's INFO chatter unless the operator asked for it.  UCX_NET_DEVICES
# is deliberately NOT defaulted here: pinning it to "lo" would silently break
# cross-host RDMA in production; tests and benches set it themselves.
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

try:  # plain `nixl` meta package
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu13._api import nixl_agent, nixl_agent_config

import attrs
import torch

from .block_sizes import SlicePair
from .descriptors import addresses, block_runs, plan_slices, plan_transfer
from .errors import MetadataRejected, NotFound, PeerDisconnected, TransferFailed, TransportError
from .handle import DONE, PROC, XferHandle
from .layout import WHOLE_BLOCK, BlockPart, CacheLayout, check_part
from .prepped import LOCAL, PreppedLists, fits, indices
from .transfer_times import TransferTimes
from .wire import METADATA_MAGIC

# NIXL exception class name -> our type.  Matched by name because the classes
# live in nixl/nixl_cu12/nixl_cu13 `_bindings` and share no base class.
_BY_NAME: dict[str, type[TransportError]] = {
    "nixlRemoteDisconnectError": PeerDisconnected,
    "nixlNotFoundError": NotFound,
}


def _is_nixl_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name.startswith("nixl") and name.endswith("Error")


def translate_nixl_error(
    exc: BaseException, what: str, default: type[TransportError] = TransferFailed
) -> TransportError:
    """Map a NIXL exception to a TransportError, keeping its text."""
    name = type(exc).__name__
    cls = _BY_NAME.get(name, default)
    return cls(f"{what}: {name}: {exc}", nixl_error=name)


def installed_plugins() -> list[str]:
    """The NIXL backend plugins this installation has (a backend may still
    fail to start: LIBFABRIC without a provider, GDS without a GPU)."""
    with _nixl("list plugins", TransportError):
        probe = nixl_agent(f"plugins-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, backends=[]))
        return list(probe.get_plugin_list())


@contextlib.contextmanager
def _nixl(what: str, default: type[TransportError] = TransferFailed) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        if _is_nixl_error(e):
            raise translate_nixl_error(e, what, default) from e
        raise


# A NIXL call slower than this is counted (see NixlEndpoint.call_times).
SLOW_CALL_S = 0.05


@attrs.define
class CallTimes:
    """The slowest NIXL call of each kind, and how many were slow.  The
    owner's step loop makes these calls, so one that blocks (a peer that
    hangs, a full queue) stalls the whole plane; this says which one did.
    Measured with nixl 1.5.1 over UCX/lo: none blocks on a SIGSTOPped peer
    (send_notif, posting, polling and releasing all return in < 1 ms)."""

    max_s: dict = attrs.Factory(dict)  # call -> longest seconds
    slow: dict = attrs.Factory(dict)  # call -> calls over SLOW_CALL_S

    def note(self, call: str, seconds: float) -> None:
        if seconds > self.max_s.get(call, 0.0):
            self.max_s[call] = seconds
        if seconds > SLOW_CALL_S:
            self.slow[call] = self.slow.get(call, 0) + 1

    def to_dict(self) -> dict:
        return {"max_s": {k: round(v, 4) for k, v in self.max_s.items()}, "slow_over_s": SLOW_CALL_S,
                "slow": dict(self.slow)}


class NixlEndpoint:
    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), num_threads: int = 0,
                 prepped: bool = True) -> None:
        """``backends``: the NIXL backends to create; ``num_threads``: their
        worker threads (NIXL's own option; 0: none).  The agent never runs a
        progress thread: the owner polls it.  ``prepped``: READs and WRITEs
        are made from prepared descriptor lists (``prepped.py``)."""
        if not name:
            raise ValueError("agent name must not be empty")
        self.name = name
        cfg = nixl_agent_config(enable_prog_thread=False, backends=list(backends), num_threads=num_threads)
        try:
            with _nixl(f"create agent {name!r}", TransportError):
                self._agent = nixl_agent(name, cfg)
        except NotFound as e:
            raise NotFound(f"create agent {name!r}: a NIXL backend of {list(backends)} cannot start here "
                           f"(plugins installed: {', '.join(installed_plugins())}): {e}", nixl_error=e.nixl_error) from e
        # NIXL skips a backend it has no plugin for with a warning: refuse it here,
        # not at the first transfer.
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise NotFound(f"create agent {name!r}: no NIXL plugin for {missing} "
                           f"(plugins installed: {', '.join(self._agent.get_plugin_list())})")
        self._tensors: list[torch.Tensor] = []  # keep registered memory alive
        self._reg_descs: list[object] = []
        self._layout: CacheLayout | None = None
        self._remotes: set[str] = set()
        # Remotes that raised PeerDisconnected: never handed to NIXL again
        # until re-added (see _post for why touching them is dangerous).
        self._disconnected: set[str] = set()
        self._notif_buf: list[tuple[str, bytes]] = []
        self._closed = False
        # Prepared descriptor lists (False: every transfer builds its own, the
        # old path, kept for caches too large to prepare and for benches).
        self.use_prepped = prepped
        self.prepped = PreppedLists(self._prep_dlist)
        self.call_times = CallTimes()
        self.transfer_times = TransferTimes()

    # ------------------------------------------------------------ memory

    def register_kv_cache(self, tensor: torch.Tensor, block_size_bytes: int) -> CacheLayout:
        """Register ``tensor`` ([num_blocks, ...], contiguous) as one more region.

        Repeated calls add regions (e.g. one per layer); they must agree on
        memory type, device, block size and block count.
        """
        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("tensor must be a torch.Tensor")
        if not tensor.is_contiguous():
            raise ValueError("KV cache tensor must be contiguous")
        if tensor.dim() < 1 or tensor.shape[0] == 0:
            raise ValueError("KV cache tensor must have shape [num_blocks, ...] with num_blocks > 0")
        nbytes = tensor.numel() * tensor.element_size()
        num_blocks = tensor.shape[0]
        if block_size_bytes * num_blocks != nbytes:
            raise ValueError(
                f"block_size_bytes={block_size_bytes} x num_blocks={num_blocks} != "
                f"tensor size {nbytes} B"
            )
        mem_type = "VRAM" if tensor.is_cuda else "DRAM"
        device_id = tensor.get_device() if tensor.is_cuda else 0
        base = tensor.data_ptr()
        if self._layout is None:
            layout = CacheLayout(mem_type, device_id, block_size_bytes, num_blocks, (base,))
        else:
            old = self._layout
            if (old.mem_type, old.device_id, old.block_size, old.num_blocks) != (
                mem_type, device_id, block_size_bytes, num_blocks
            ):
                raise ValueError(
                    f"region ({mem_type}, dev {device_id}, {block_size_bytes} B x {num_blocks}) "
                    f"does not match the cache ({old.mem_type}, dev {old.device_id}, "
                    f"{old.block_size} B x {old.num_blocks})"
                )
            layout = attrs.evolve(old, base_addrs=old.base_addrs + (base,))
        with _nixl("register_memory", TransportError):
            reg = self._agent.register_memory(tensor)
        self._tensors.append(tensor)
        self._reg_descs.append(reg)
        self._layout = layout
        # The local lists describe the regions registered before this one
        # (an engine registers a region per layer): the whole-block list is
        # prepared again at the next add_remote, when the cache is complete.
        self.prepped.drop(LOCAL)
        return layout

    def describe_cache(self) -> dict:
        """Serializable layout a peer passes to post_read/post_write."""
        self._check_open()
        if self._layout is None:
            raise RuntimeError("no KV cache registered")
        return self._layout.to_dict()

    # ------------------------------------------------------------ peers

    def local_metadata(self) -> bytes:
        """Unframed NIXL agent metadata (frame it before it goes on the wire)."""
        self._check_open()
        with _nixl("get_agent_metadata", TransportError):
            return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's (unframed) metadata; returns the peer's agent name."""
        self._check_open()
        metadata = bytes(metadata)
        if metadata.startswith(METADATA_MAGIC):
            raise ValueError("metadata is still framed; call wire.unframe_metadata first")
        with self._timed("add_remote_agent"), _nixl("add_remote_agent", MetadataRejected):
            name = self._agent.add_remote_agent(metadata)
        # NIXL returns the name as bytes here but keys notifications by str.
        if isinstance(name, bytes):
            name = name.decode()
        # NIXL refuses a name it holds, so a new incarnation comes through
        # remove_remote, which dropped the old one's lists; dropped here too,
        # so no list made before this add is ever used with this agent.
        self.prepped.drop(name)
        self._remotes.add(name)
        self._disconnected.discard(name)
        # The local whole-block list, off the post's path (a READ follows a handshake).
        if self.use_prepped and self._layout is not None and fits(self._layout, 1):
            with _nixl("prep_xfer_dlist local", TransportError):
                self.prepped.get(LOCAL, self._layout, 1)
        return name

    def remove_remote(self, name: str) -> None:
        self._check_open()
        self._remotes.discard(name)
        self._disconnected.discard(name)
        self.prepped.drop(name)
        with self._timed("remove_remote_agent"), _nixl(f"remove_remote_agent {name!r}", NotFound):
            self._agent.remove_remote_agent(name)

    def connect(self, remote_name: str) -> None:
        """Optional: set up the connection now so the first transfer is not slower."""
        self._check_open()
        with _nixl(f"make_connection {remote_name!r}", PeerDisconnected):
            self._agent.make_connection(remote_name)

    # ------------------------------------------------------------ transfers

    def post_read(
        self,
        remote_name: str,
        remote_desc: dict,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notif: bytes = b"",
        *,
        remote_part: BlockPart = WHOLE_BLOCK,
        local_part: BlockPart = WHOLE_BLOCK,
        local_first_region: int | None = None,
    ) -> XferHandle:
        """Pull remote blocks (their ``remote_part``) into local blocks (their
        ``local_part``); ``notif`` reaches the peer on completion.
        ``local_first_region``: the remote holds a layer slice whose regions
        go to local regions from there (``layer_slice``)."""
        return self._post("READ", remote_name, remote_desc, remote_block_ids, local_block_ids, notif,
                          remote_part, local_part, local_first_region)

    def post_write(
        self,
        remote_name: str,
        remote_desc: dict,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notif: bytes = b"",
        *,
        remote_part: BlockPart = WHOLE_BLOCK,
        local_part: BlockPart = WHOLE_BLOCK,
        local_first_region: int | None = None,
    ) -> XferHandle:
        """Push local blocks (their ``local_part``) into remote blocks (their
        ``remote_part``) (push mode)."""
        return self._post("WRITE", remote_name, remote_desc, remote_block_ids, local_block_ids, notif,
                          remote_part, local_part, local_first_region)

    def _post(self, op, remote_name, remote_desc, remote_block_ids, local_block_ids, notif,
              remote_part, local_part, local_first_region=None):
        posted_at = time.perf_counter()
        self._check_open()
        remote_part = check_part(remote_part, "remote")
        local_part = check_part(local_part, "local")
        local = self._require_layout()
        remote = CacheLayout.from_dict(remote_desc)
        slice_bytes = local.check_pairable_parts(remote, local_part, remote_part, local_first_region)
        remote_block_ids, local_block_ids = list(remote_block_ids), list(local_block_ids)
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(
                f"{len(remote_block_ids)} remote blocks vs {len(local_block_ids)} local blocks"
            )
        if not local_block_ids:
            raise ValueError("a transfer needs at least one block")
        local.check_block_ids(local_block_ids, "local")
        remote.check_block_ids(remote_block_ids, "remote")
        # A layer slice's regions map to a run of local regions: the prepared
        # lists pair all regions, so a slice builds its own lists.
        if (self.use_prepped and local_first_region is None and fits(local, local_part[1])
                and fits(remote, remote_part[1])):
            return self._post_prepped(op, remote_name, local, remote, remote_block_ids, local_block_ids, notif,
                                      remote_part, local_part, slice_bytes, posted_at)
        plan = plan_transfer(local, remote, local_block_ids, remote_block_ids, local_part, remote_part,
                             slice_bytes, local_first_region)
        return self._post_plan(op, remote_name, remote, plan, len(local_block_ids), notif, posted_at)

    def post_read_slices(self, remote_name: str, remote_desc: dict, slices: Sequence[SlicePair],
                         notif: bytes = b"") -> XferHandle:
        """Pull each slice pair's remote slice into its local slice (blocks of
        different sizes: ``block_sizes.slice_pairs``)."""
        return self._post_slices("READ", remote_name, remote_desc, slices, notif)

    def post_write_slices(self, remote_name: str, remote_desc: dict, slices: Sequence[SlicePair],
                          notif: bytes = b"") -> XferHandle:
        """Push each slice pair's local slice into its remote slice."""
        return self._post_slices("WRITE", remote_name, remote_desc, slices, notif)

    def _post_slices(self, op, remote_name, remote_desc, slices, notif) -> XferHandle:
        posted_at = time.perf_counter()
        self._check_open()
        local = self._require_layout()
        remote = CacheLayout.from_dict(remote_desc)
        plan = plan_slices(local, remote, list(slices))
        return self._post_plan(op, remote_name, remote, plan, len({s.local_block for s in slices}), notif,
                               posted_at)

    def _post_plan(self, op, remote_name, remote, plan, num_blocks, notif, posted_at) -> XferHandle:
        local = self._require_layout()
        notif = bytes(notif)
        self._ready_to_post(op, remote_name)
        with self._timed("initialize_xfer"), self._watch(remote_name), _nixl(f"{op} to {remote_name!r}"):
            raw = self._agent.initialize_xfer(
                op, self._agent.get_xfer_descs(addresses(local, plan.local), local.mem_type),
                self._agent.get_xfer_descs(addresses(remote, plan.remote), remote.mem_type),
                remote_name, notif,
            )
        handle = XferHandle(op, remote_name, notif, num_blocks, raw, nbytes=plan.nbytes,
                            descriptors=plan.descriptors, posted_at=posted_at)
        return self._start(handle)

    def _post_prepped(self, op, remote_name, local, remote, remote_block_ids, local_block_ids, notif,
                      remote_part, local_part, slice_bytes, posted_at) -> XferHandle:
        notif = bytes(notif)
        self._ready_to_post(op, remote_name)
        with self._timed("make_prepped_xfer"), self._watch(remote_name), _nixl(f"{op} to {remote_name!r}"):
            raw = self._agent.make_prepped_xfer(
                op, self.prepped.get(LOCAL, local, local_part[1]),
                indices(local, local_block_ids, local_part),
                self.prepped.get(remote_name, remote, remote_part[1]),
                indices(remote, remote_block_ids, remote_part), notif,
            )
        whole = local_part[1] == 1 and remote_part[1] == 1
        runs = len(block_runs(local_block_ids, remote_block_ids, coalesce=whole))
        regions = len(local.base_addrs)
        handle = XferHandle(op, remote_name, notif, len(local_block_ids), raw,
                            nbytes=len(local_block_ids) * slice_bytes * regions,
                            descriptors=runs * regions, posted_at=posted_at)
        return self._start(handle)

    def _ready_to_post(self, op: str, remote_name: str) -> None:
        self._check_remote(remote_name, op)
        # Measured with nixl 1.5.1: posting to a peer that died since the last
        # UCX progress makes UCX abort the whole process later, when the agent
        # is destroyed (ucs_arbiter_group_is_empty assertion).  One progress
        # call first lets UCX see the disconnect, and the post then fails cleanly.
        self._progress()
        self._check_remote(remote_name, op)

    def _start(self, handle: XferHandle) -> XferHandle:
        op, remote_name = handle.op, handle.remote_name
        try:
            with self._timed("transfer"), self._watch(remote_name), _nixl(f"post {op} to {remote_name!r}"):
                state = self._agent.transfer(handle.raw)
            if state not in (DONE, PROC):
                raise TransferFailed(f"post {op} to {remote_name!r} returned {state}")
        except TransportError:
            self.release(handle, missing_ok=True)
            raise
        if state == DONE:
            self._done(handle)
        return handle

    def poll_transfer(self, handle: XferHandle) -> str:
        """"DONE" or "PROC"; a failed transfer raises a TransportError subclass."""
        self._check_open()
        if handle.released:
            raise NotFound(f"transfer {handle.id} was already released")
        with self._timed("check_xfer_state"), self._watch(handle.remote_name), \
                _nixl(f"{handle.op} {handle.id} to {handle.remote_name!r}"):
            state = self._agent.check_xfer_state(handle.raw)
        if state == "ERR":
            raise TransferFailed(f"{handle.op} {handle.id} to {handle.remote_name!r} failed")
        if state == DONE and handle.done_at is None:
            self._done(handle)
        return state

    def _done(self, handle: XferHandle) -> None:
        handle.done_at = time.perf_counter()
        self.transfer_times.note(handle.op, handle.nbytes, handle.descriptors, handle.done_at - handle.posted_at)

    def release(self, handle: XferHandle, *, missing_ok: bool = False) -> None:
        """Free a handle; NIXL tries to cancel a transfer still in flight."""
        if handle.released:
            if missing_ok:
                return
            raise NotFound(f"transfer {handle.id} was already released")
        with self._timed("release_xfer"), _nixl(f"release {handle.op} {handle.id}"):
            handle.raw.release()
        handle.released = True

    # ------------------------------------------------------------ notifications

    def send_notif(self, remote_name: str, msg: bytes) -> None:
        self._check_open()
        self._check_remote(remote_name, "send_notif")
        with self._timed("send_notif"), self._watch(remote_name), \
                _nixl(f"send_notif to {remote_name!r}", PeerDisconnected):
            self._agent.send_notif(remote_name, bytes(msg))

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Drain notifications that arrived since the last call (also progresses UCX)."""
        self._check_open()
        self._progress()
        out, self._notif_buf = self._notif_buf, []
        return out

    def progress(self) -> int:
        """Progress UCX only (a passive side serving READs between steps);
        returns how many notifications are waiting for :meth:`poll_notifs`."""
        self._check_open()
        self._progress()
        return len(self._notif_buf)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.prepped.drop_all()
        for reg in self._reg_descs:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)
        self._reg_descs.clear()
        self._tensors.clear()
        del self._agent

    def __enter__(self) -> "NixlEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"endpoint {self.name!r} is closed")

    def _progress(self) -> None:
        """Progress UCX (get_new_notifs is the only progress call); keep what arrives."""
        with self._timed("get_new_notifs"), _nixl("get_new_notifs", TransportError):
            got = self._agent.get_new_notifs()
        for name, msgs in got.items():
            name = name.decode() if isinstance(name, bytes) else name
            self._notif_buf.extend((name, bytes(m)) for m in msgs)

    def _prep_dlist(self, owner: str, table: object, mem_type: str) -> object:
        with self._timed("prep_xfer_dlist"):
            return self._agent.prep_xfer_dlist(owner or "NIXL_INIT_AGENT", table, mem_type)

    def _check_remote(self, remote_name: str, what: str) -> None:
        if remote_name in self._disconnected:
            raise PeerDisconnected(f"{what}: remote agent {remote_name!r} disconnected earlier")
        if remote_name not in self._remotes:
            raise NotFound(f"{what}: unknown remote agent {remote_name!r} (add_remote first)")

    @contextlib.contextmanager
    def _timed(self, call: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.call_times.note(call, time.monotonic() - t)

    @contextlib.contextmanager
    def _watch(self, remote_name: str) -> Iterator[None]:
        try:
            yield
        except PeerDisconnected:
            self._disconnected.add(remote_name)
            raise

    def _require_layout(self) -> CacheLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_cache before posting transfers")
        return self._layout
