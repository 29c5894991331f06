"""``kv_transfer_params``: what one side hands the other through the proxy.

Same spirit as vLLM's NixlConnector params (remote engine id, host, port,
block ids, request id), plus the lease facts kvplane needs: how many
consumers P planned and, for a decoder's held blocks, their expiry in the
holder's clock.
"""
from __future__ import annotations

from typing import Any

import attrs

from kvplane.transport import wire

# Ranks of one engine (its TP x PP size) a request's blocks may live on.
MAX_RANKS = 1024


class BadTransferParams(ValueError):
    """kv_transfer_params missing a field or with a wrong type; names the field."""


@attrs.frozen(kw_only=True)
class RemoteKV:
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: tuple = attrs.field(converter=tuple)
    remote_ranks: tuple = attrs.field(converter=tuple, default=(0,))
    expected_consumers: int = 1
    remote_expiry: float | None = None
    # True for P's lease (our heartbeats extend it), False for a decoder's hold.
    remote_renewable: bool = False
    # The holder's tensor-parallel size (vLLM's key) and each rank's side
    # channel port on remote_host; absent: rank r listens on remote_port + r.
    tp_size: int = 1
    remote_rank_ports: tuple = attrs.field(converter=lambda ports: tuple(ports), default=())
    # The holder's pipeline-parallel size (NixlConnector's ``pp_size``): its
    # ranks are stage x TP rank, ``stage * tp_size + tp rank``, each with its
    # port and incarnation in the lists above (tp_size x pp_size of each).
    pp_size: int = 1
    # The CURVE public key (z85) the holder's side channel must prove: set by
    # D from the deployment key that vouched for the params, never read from
    # them (None: the key the driver already knows for the engine, if any).
    remote_public_key: bytes | None = None
    # Each rank's incarnation (the token its handshake reply names) when the
    # holder granted the blocks; empty: not said (nothing is checked).  A
    # reader reads only from the incarnation named (decode_request's guard).
    remote_rank_incarnations: tuple = attrs.field(converter=lambda names: tuple(names), default=())

    def __attrs_post_init__(self) -> None:
        if not self.remote_rank_ports:
            object.__setattr__(self, "remote_rank_ports",
                               tuple(self.remote_port + r for r in range(self.ranks)))

    @property
    def ranks(self) -> int:
        """The holder's ranks: TP x PP."""
        return self.tp_size * self.pp_size

    def incarnation_of(self, rank: int) -> str | None:
        """The incarnation of the holder's ``rank`` the params name (None: none named)."""
        return self.remote_rank_incarnations[rank] if self.remote_rank_incarnations else None

    def rank_side_channel(self, rank: int) -> str:
        return f"tcp://{self.remote_host}:{self.remote_rank_ports[rank]}"

    @property
    def side_channel(self) -> str:
        return f"tcp://{self.remote_host}:{self.remote_port}"

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)  # its tuples become lists below (recursing costs 5x)
        del d["remote_public_key"]  # ours, never on the wire
        d["remote_block_ids"] = list(self.remote_block_ids)
        d["remote_ranks"] = list(self.remote_ranks)
        d["remote_rank_ports"] = list(self.remote_rank_ports)
        d["remote_rank_incarnations"] = list(self.remote_rank_incarnations)
        return d

    @classmethod
    def from_dict(cls, d: Any, *, public_key: bytes | None = None) -> "RemoteKV":
        """Validate ``kv_transfer_params`` from the proxy: every wrong type,
        value or size raises BadTransferParams naming the field, never a bare
        TypeError.  The ids and counts must be ones a notification can carry
        (transport.wire's bounds), so nothing accepted here fails later when
        the READ's completion is encoded.  Keys kvplane does not use (vLLM's
        do_remote_prefill, push, ...) are ignored.  ``public_key``: the
        reader's own ``remote_public_key`` (never read from ``d``)."""
        if not isinstance(d, dict):
            raise BadTransferParams(f"kv_transfer_params must be a dict, got {type(d).__name__}")
        for name in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids"):
            if name not in d:
                raise BadTransferParams(f"kv_transfer_params: missing {name!r}")

        def check(name: str, problem: str | None) -> None:
            if problem is not None:
                raise BadTransferParams(f"kv_transfer_params: {name!r}: {problem}")

        check("remote_engine_id", wire.name_problem(d["remote_engine_id"], "engine id"))
        check("remote_host", wire.host_problem(d["remote_host"]))
        check("remote_port", wire.port_problem(d["remote_port"]))
        check("remote_request_id", wire.id_problem(d["remote_request_id"]))
        check("remote_block_ids", wire.block_ids_problem(d["remote_block_ids"]))
        ranks = d.get("remote_ranks", (0,))  # absent: rank 0; null is a wrong type like any other
        if not isinstance(ranks, (list, tuple)) or not 1 <= len(ranks) <= MAX_RANKS or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANKS for r in ranks):
            check("remote_ranks", f"must be a list of 1 to {MAX_RANKS} ints in 0..{MAX_RANKS - 1}, "
                                  f"got {_short(ranks)}")
        consumers = d.get("expected_consumers", 1)
        if isinstance(consumers, bool) or not isinstance(consumers, int) or not (
                1 <= consumers <= wire.MAX_EXPECTED_CONSUMERS):
            check("expected_consumers", f"must be an int in 1..{wire.MAX_EXPECTED_CONSUMERS}, got {_short(consumers)}")
        expiry = d.get("remote_expiry")
        # A NaN expiry compares false with everything: the READ gate would
        # never see it as past.  Only a finite number (or none) is an expiry.
        check("remote_expiry", wire.finite_problem(expiry, "the expiry"))
        renewable = d.get("remote_renewable", False)
        if not isinstance(renewable, bool):
            check("remote_renewable", f"must be a bool, got {_short(renewable)}")
        tp_size = d.get("tp_size", 1)
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or not 1 <= tp_size <= MAX_RANKS:
            check("tp_size", f"must be an int in 1..{MAX_RANKS}, got {_short(tp_size)}")
        pp_size = d.get("pp_size")
        pp_size = 1 if pp_size is None else pp_size  # absent (or unsigned: None): one stage
        if isinstance(pp_size, bool) or not isinstance(pp_size, int) or not 1 <= pp_size <= MAX_RANKS // tp_size:
            check("pp_size", f"must be an int in 1..{MAX_RANKS // tp_size} (tp_size x pp_size ranks at most "
                             f"{MAX_RANKS}), got {_short(pp_size)}")
        holder_ranks = tp_size * pp_size
        ports = d.get("remote_rank_ports")
        if ports is not None:
            if not isinstance(ports, (list, tuple)) or len(ports) != holder_ranks:
                check("remote_rank_ports", f"must be a list of tp_size x pp_size ({holder_ranks}) ports, got {_short(ports)}")
            for port in ports:
                check("remote_rank_ports", wire.port_problem(port))
        elif d["remote_port"] + holder_ranks - 1 > 65535:
            check("tp_size", f"{holder_ranks} ranks from port {d['remote_port']} run past port 65535")
        incarnations = d.get("remote_rank_incarnations") or ()
        if not isinstance(incarnations, (list, tuple)) or incarnations and len(incarnations) != holder_ranks:
            check("remote_rank_incarnations", f"must be a list of tp_size x pp_size ({holder_ranks}) names, got "
                                              f"{_short(incarnations)}")
        for name in incarnations:
            check("remote_rank_incarnations", wire.name_problem(name, "an incarnation"))
        return cls(
            remote_rank_incarnations=incarnations,
            tp_size=tp_size, pp_size=pp_size, remote_rank_ports=ports or (),
            remote_engine_id=d["remote_engine_id"], remote_host=d["remote_host"], remote_port=d["remote_port"],
            remote_request_id=d["remote_request_id"], remote_block_ids=d["remote_block_ids"],
            remote_ranks=ranks, expected_consumers=consumers,
            remote_expiry=None if expiry is None else float(expiry), remote_renewable=renewable,
            remote_public_key=public_key,
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
