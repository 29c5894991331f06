"""A hybrid model's KV cache groups, as kvplane moves them.

vLLM's hybrid KV cache manager gives a model with sliding-window and full
attention layers one KV cache group per kind; every group draws from one
block pool and the groups' layers overlay the same KV tensors, so a block
id names the same bytes in every registered region whatever its group.
vLLM hands a connector one block list per group (``tuple[list[int], ...]``),
each covering the whole sequence: block ``i`` of every group holds tokens
``i * block_size ..``; a sliding-window group's blocks before the window
are the null block (id 0) once vLLM cleaned them up.

What crosses P and D is one list per group, clipped as NixlConnector
clips (``get_exchange_clipped_blocks``): a sliding-window group sends
only its last ``cdiv(window, block_size) + 1`` blocks, of which the null
ones (cleaned up) are not moved (``without_null``).  The plane below
needs no groups: it moves a flat list of (remote, local) block pairs
through the registered regions, pairing the two lists from their ends
(``driver._align_tail``).  ``interleave`` orders a group list so that this
tail pairing pairs each group's blocks with the same group's blocks: both
sides' lists end at the prompt's last block and each holds a tail of it
(``paired``).
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs

NULL_BLOCK = 0  # vLLM's null block: a placeholder, never a request's KV

Groups = tuple[tuple[int, ...], ...]


@attrs.frozen
class KvGroups:
    """Per KV cache group, how many trailing blocks it moves (0: all of them:
    full attention)."""

    window_blocks: tuple[int, ...] = (0,)

    @classmethod
    def from_windows(cls, windows: Sequence[int | None], block_size: int) -> "KvGroups":
        """``windows``: each group's sliding window in tokens (None or 0: full
        attention), as NixlConnector's ``blocks_per_sw``."""
        return cls(tuple(-(-int(w) // block_size) + 1 if w else 0 for w in windows))

    @property
    def count(self) -> int:
        return len(self.window_blocks)

    def clip(self, groups: Sequence[Sequence[int]]) -> Groups:
        """The blocks each group moves (its tail, for a sliding window)."""
        if len(groups) != self.count:
            raise ValueError(f"{len(groups)} block lists for {self.count} KV cache groups")
        return tuple(tuple(g[-w:]) if w else tuple(g) for g, w in zip(groups, self.window_blocks))

    def expected(self, num_tokens: int, block_size: int) -> tuple[int, ...]:
        """How many blocks each group's list has for ``num_tokens`` tokens."""
        n = -(-num_tokens // block_size)
        return tuple(min(n, w) if w else n for w in self.window_blocks)

    def cover_problem(self, blocks: Any, num_tokens: int, block_size: int) -> str | None:
        """Why ``blocks`` (one list per group) is not exactly the blocks of
        ``num_tokens`` tokens, or None.  Only a sliding group may name the
        null block (a cleaned-up block inside the clip); every other id once."""
        if not isinstance(blocks, (list, tuple)) or len(blocks) != self.count or \
                not all(isinstance(g, (list, tuple)) for g in blocks):
            return f"not {self.count} block lists (one per KV cache group)"
        seen: set[int] = set()
        for i, (group, need, window) in enumerate(zip(blocks, self.expected(num_tokens, block_size),
                                                      self.window_blocks)):
            if len(group) != need:
                return f"group {i}: {len(group)} blocks for {num_tokens} tokens of {block_size} (needs {need})"
            for b in group:
                if isinstance(b, bool) or not isinstance(b, int):
                    return f"group {i}: block id {b!r:.40} is not an int"
                if b == NULL_BLOCK:
                    if window:
                        continue
                    return f"group {i}: the null block in a full-attention group"
                if b in seen:
                    return f"group {i}: block {b} twice"
                seen.add(b)
        return None


def without_null(groups: Sequence[Sequence[int]]) -> Groups:
    """The groups less vLLM's null block: a sliding group's clip may begin
    with a block P's vLLM already cleaned up (out of the window), which holds
    no KV and which D's vLLM does not allocate either (it allocates a
    sliding group's blocks from the window on)."""
    return tuple(tuple(b for b in g if b != NULL_BLOCK) for g in groups)


def interleave(groups: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """One flat list of every group's blocks, ordered by the token position
    of each block (the groups' lists all end at the same last block), then
    by group: the order both sides flatten in."""
    longest = max((len(g) for g in groups), default=0)
    return tuple(g[len(g) - back] for back in range(longest, 0, -1) for g in groups if len(g) >= back)


def paired(remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]) -> tuple[Groups, Groups]:
    """Each group's (remote, local) blocks, paired from the end as vLLM
    does: on a prefix hit D lacks only the tail; a sliding group's shorter
    list pairs with the other side's last blocks."""
    r_out, l_out = [], []
    for r, loc in zip(remote, local):
        n = min(len(r), len(loc))
        r_out.append(tuple(r[len(r) - n:]))
        l_out.append(tuple(loc[len(loc) - n:]))
    return tuple(r_out), tuple(l_out)


def local_for(remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]) -> tuple[int, ...] | None:
    """D's flat local list for P's ``remote`` groups: pairing it with
    ``interleave(remote)`` from the end (the driver's rule) pairs every
    group's blocks with its own; None if no flat list does (lists that are
    not tails of one sequence)."""
    if len(remote) != len(local):
        return None
    rem, loc = paired(remote, local)
    flat_local = interleave(loc)
    flat_remote = interleave(remote)
    n = len(flat_local)
    if n > len(flat_remote) or flat_remote[len(flat_remote) - n:] != interleave(rem):
        return None
    return flat_local


ONE_GROUP = KvGroups()  # a model with one (full-attention) KV cache group
