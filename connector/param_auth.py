"""P vouches for the ``kv_transfer_params`` it hands out; D checks them.

Anyone who can reach an engine's OpenAI API can send any params, so D acts
only on params P authenticated with the deployment secret (``secret``):
P adds one key, ``kvplane_auth``, which a proxy carries along untouched::

    {"v": 1, "kid": <key id>, "prompt_sha256": <hex>, "issued": <P's clock>, "mac": <hex>}

``mac`` is HMAC-SHA256 over a canonical msgpack encoding of the version,
key id, prompt hash, issue time and exactly the params D acts on
(``SIGNED``: where to connect, which lease, which blocks, how many tokens,
until when, for how many consumers, how, and which incarnation of each
holder rank holds them).  Nothing else a client adds is
read: the params D registers are rebuilt from the signed fields only, so an
unauthenticated ``remote_blocks_expiry_time`` is ignored.

Besides the MAC, D checks (``check_for_request``) that the params were made
for its own request: the prompt hash is the hash of the tokens the blocks
hold (sha256 over the token ids as little-endian u32), the token count is
its prompt's, and the block list is exactly the blocks of those tokens.
``ConsumedLeases`` makes params single-use per consumer engine.
"""
from __future__ import annotations

import array
import hashlib
import heapq
import hmac
import math
import sys
from typing import Any, Iterable

import attrs
import msgpack

from .kv_groups import KvGroups
from .params import BadTransferParams
from .secret import DeploymentKeys, DerivedKey

AUTH_KEY = "kvplane_auth"
AUTH_VERSION = 1
# The params D acts on, all signed (vLLM's shape; remote_block_ids flat).
SIGNED = ("remote_engine_id", "remote_host", "remote_port", "remote_rank_ports", "remote_ranks", "tp_size",
          "remote_request_id", "remote_block_ids", "remote_num_tokens", "remote_expiry", "remote_renewable",
          "expected_consumers", "transfer_mode", "remote_rank_incarnations", "pp_size")
MAX_TOKENS = 1 << 24
# How long past a lease's term D remembers it consumed it (clock skew, the
# READ gate's own margin).
CONSUMED_SLACK_S = 30.0
MAX_CONSUMED_TERM_S = 86400.0
MAX_CONSUMED = 1 << 17


class RefusedParams(BadTransferParams):
    """Params D does not act on: unauthenticated, tampered, made for another
    prompt, not covering exactly the tokens to load, or replayed.
    ``reason`` is a short fixed phrase (a count's label, never client data)."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"kv_transfer_params refused: {reason}" + (f" ({detail})" if detail else ""))


def prompt_digest(token_ids: Iterable[int]) -> str:
    """sha256 of token ids as little-endian u32; ValueError for ids that are
    no u32 (prompt embeddings have no ids: nothing to vouch for)."""
    try:
        packed = array.array("I", token_ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids are not u32: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every platform vLLM runs on
        packed = array.array("L", packed)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return hashlib.sha256(packed.tobytes()).hexdigest()


def _canonical(fields: dict[str, Any], kid: str, prompt: str, issued: float) -> bytes:
    body = [[name, fields.get(name)] for name in SIGNED]
    return msgpack.packb([AUTH_VERSION, kid, prompt, issued, body], use_bin_type=True)


def _mac(key: DerivedKey, message: bytes) -> str:
    return hmac.new(key.mac_key, message, hashlib.sha256).hexdigest()


def _normal(fields: dict[str, Any]) -> dict[str, Any]:
    """The signed fields as both sides encode them: block ids one flat list,
    the expiry a float (a JSON hop may write 100.0 as 100)."""
    out = {name: fields.get(name) for name in SIGNED}
    blocks = out["remote_block_ids"]
    if isinstance(blocks, (list, tuple)) and blocks and all(isinstance(g, (list, tuple)) for g in blocks):
        # One group: its flat list (the encoding before hybrid models); several:
        # one list per group, so a block cannot move between groups unsigned.
        out["remote_block_ids"] = list(blocks[0]) if len(blocks) == 1 else [list(g) for g in blocks]
    for name in ("remote_block_ids", "remote_rank_ports", "remote_ranks", "remote_rank_incarnations"):
        value = out[name]
        if isinstance(value, tuple):
            out[name] = list(value)
    expiry = out["remote_expiry"]
    if isinstance(expiry, int) and not isinstance(expiry, bool):
        out["remote_expiry"] = float(expiry)
    return out


def sign(params: dict[str, Any], *, prompt_sha256: str, issued: float, key: DerivedKey) -> dict[str, Any]:
    """``params`` (vLLM's shape, as P returns them) with ``kvplane_auth``."""
    message = _canonical(_normal(params), key.key_id, prompt_sha256, float(issued))
    return dict(params, **{AUTH_KEY: {"v": AUTH_VERSION, "kid": key.key_id, "prompt_sha256": prompt_sha256,
                                      "issued": float(issued), "mac": _mac(key, message)}})


@attrs.frozen
class Vouched:
    """Params whose MAC verified: the signed fields (nothing else the
    client sent), the key that signed them, what the MAC also covered."""

    fields: dict[str, Any]
    key: DerivedKey
    prompt_sha256: str
    issued: float

    @property
    def lease_name(self) -> str:
        return self.fields["remote_request_id"]

    @property
    def term(self) -> float:
        """How long the lease was granted for (P's expiry - P's issue time)."""
        return self.fields["remote_expiry"] - self.issued


def verify(params: dict[str, Any], keys: DeploymentKeys) -> Vouched:
    """The signed fields of ``params`` if P's MAC over them verifies with a
    key of the deployment; else RefusedParams."""
    auth = params.get(AUTH_KEY)
    if auth is None:
        raise RefusedParams("not authenticated", f"no {AUTH_KEY}")
    if not isinstance(auth, dict) or set(auth) != {"v", "kid", "prompt_sha256", "issued", "mac"}:
        raise RefusedParams("malformed authentication")
    if auth["v"] != AUTH_VERSION or isinstance(auth["v"], bool):
        raise RefusedParams("unknown authentication version")
    key = keys.by_id(auth["kid"]) if isinstance(auth["kid"], str) else None
    if key is None:
        raise RefusedParams("unknown key", "signed with a secret this engine does not hold")
    prompt, issued, mac = auth["prompt_sha256"], auth["issued"], auth["mac"]
    if not (isinstance(prompt, str) and len(prompt) == 64 and isinstance(mac, str) and len(mac) == 64
            and isinstance(issued, (int, float)) and not isinstance(issued, bool) and math.isfinite(issued)):
        raise RefusedParams("malformed authentication")
    fields = _normal(params)
    try:
        message = _canonical(fields, key.key_id, prompt, float(issued))
    except (TypeError, ValueError, OverflowError):  # a value msgpack cannot encode was never signed
        raise RefusedParams("bad signature") from None
    if not hmac.compare_digest(_mac(key, message), mac):
        raise RefusedParams("bad signature")
    return Vouched(fields=fields, key=key, prompt_sha256=prompt, issued=float(issued))


def check_for_request(v: Vouched, *, prompt_token_ids: Any, num_prompt_tokens: int, block_size: int,
                      prefix: bool = False, groups: KvGroups | None = None) -> None:
    """The vouched params are for this request's prompt and name exactly
    its blocks; RefusedParams otherwise.  Signed values were made by P, but
    a P bug must not become wrong KV either, so their types are checked.
    ``prefix`` (a decoder's held blocks read by the next turn): the signed
    tokens need only begin the prompt (the next turn's prompt is the held
    tokens plus the answer's last token and new text); the hash still covers
    every signed token and the blocks exactly them."""
    f = v.fields
    tokens, blocks, expiry = f["remote_num_tokens"], f["remote_block_ids"], f["remote_expiry"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise RefusedParams("bad token count")
    if isinstance(expiry, bool) or not isinstance(expiry, float) or not math.isfinite(expiry) or v.term <= 0:
        raise RefusedParams("bad expiry")
    fits = tokens <= num_prompt_tokens if prefix else tokens == num_prompt_tokens
    if not fits:
        raise RefusedParams("token count is not the prompt's", f"{tokens} vs {num_prompt_tokens}")
    if prompt_token_ids is None:
        raise RefusedParams("prompt has no token ids")
    try:
        digest = prompt_digest(list(prompt_token_ids)[:tokens])
    except (TypeError, ValueError):
        raise RefusedParams("prompt has no token ids") from None
    if not hmac.compare_digest(digest, v.prompt_sha256):
        raise RefusedParams("made for another prompt")
    if groups is not None and groups.count > 1:  # a hybrid model: one list per group, each clipped alike
        problem = groups.cover_problem(blocks, tokens, block_size)
        if problem is not None:
            raise RefusedParams("blocks do not cover the tokens", problem)
        return
    need = -(-tokens // block_size)
    if not isinstance(blocks, list) or len(blocks) != need:
        raise RefusedParams("blocks do not cover the tokens", f"{len(blocks) if isinstance(blocks, list) else '?'}"
                                                              f" blocks for {tokens} tokens of {block_size}")
    if len(set(blocks)) != len(blocks):
        raise RefusedParams("blocks do not cover the tokens", "a block twice")


class ConsumedLeases:
    """The lease names this engine accepted params for, each remembered
    until its term (the signed expiry - issue time, from when D first saw
    it, plus slack) is over: after that the READ gate declines them anyway.
    Bounded: at ``cap`` names, new params are refused (fail closed) until
    names expire."""

    def __init__(self, cap: int = MAX_CONSUMED):
        self.cap = cap
        self._until: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._until)

    def _expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            until, name = heapq.heappop(self._heap)
            if self._until.get(name) == until:
                del self._until[name]

    def consume(self, name: str, term: float, now: float) -> None:
        """Remember ``name`` as used; RefusedParams if it already was, or the
        memory is full."""
        self._expire(now)
        if name in self._until:
            raise RefusedParams("replayed", "these params were already used here")
        if len(self._until) >= self.cap:
            raise RefusedParams("replay memory full")
        until = now + min(max(term, 0.0), MAX_CONSUMED_TERM_S) + CONSUMED_SLACK_S
        self._until[name] = until
        heapq.heappush(self._heap, (until, name))
