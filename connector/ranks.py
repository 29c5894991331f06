"""How one engine's worker ranks are named to their peers.

Each tensor-parallel rank of an engine runs its own plane, NIXL agent and
side channel, so a peer sees it as an engine of its own: ``"<engine>/tp<r>"``.
All ranks of an engine share the engine's CURVE key, so trusting an engine
trusts every rank of it (``base_engine_id``).
"""
from __future__ import annotations

SEPARATOR = "/tp"


def rank_engine_id(engine_id: str, rank: int) -> str:
    return f"{engine_id}{SEPARATOR}{rank}"


def split_rank_engine_id(name: str) -> tuple[str, int] | None:
    """(engine id, rank) of a rank engine id, or None for a plain engine id."""
    base, sep, rank = name.rpartition(SEPARATOR)
    if not sep or not base or not rank.isdigit() or rank != str(int(rank)):
        return None
    return base, int(rank)


def base_engine_id(name: str) -> str:
    split = split_rank_engine_id(name)
    return name if split is None else split[0]


def rank_of(name: str) -> int:
    split = split_rank_engine_id(name)
    return 0 if split is None else split[1]
