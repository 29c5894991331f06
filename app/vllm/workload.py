"""The vLLM job's synthetic stream: prompts as token ids, seeded.

Prompts come in families that share a prefix (two or three KV blocks of
128 tokens), so D finds the prefix of a later request of a family in its
own prefix cache and reads only the rest; some prompts repeat an earlier
one exactly (D has every full block and reads only the last).  Lengths
vary from under one block to several.  The first ``burst`` requests
arrive at once, more than D's ``max_num_seqs``, so they wait in D's queue
while the connector's heartbeats keep P's leases alive (the overload);
the rest (the steady stream, whose TTFT the job reports) are sent once
the burst is done, ``spacing`` seconds apart.
"""
from __future__ import annotations

import random

import attrs

BLOCK_TOKENS = 128  # vLLM's CPU block size
VOCAB_LO, VOCAB_HI = 3, 1023  # token ids (0-2 are unk/bos/eos)


@attrs.frozen
class VllmRequest:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: float  # seconds after the stream starts
    family: int
    repeat_of: int | None  # an exact repeat of request N's prompt
    late: bool  # the proxy forwards it to D late (--late-forward)
    burst: bool  # one of the opening burst (queued on D); the others are the steady stream
    tag_suffix: str = ""  # "t2": a conversation's second turn

    @property
    def tag(self) -> str:
        return f"r{self.index}{self.tag_suffix}"


def make_stream(n: int, *, seed: int = 0, burst: int = 8, spacing: float = 0.5,
                families: int = 4, late_every: int = 0) -> list[VllmRequest]:
    """``late_every``: every k-th request (k >= 1) is forwarded late; 0: none."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(BLOCK_TOKENS * rng.choice((2, 3))))
                for _ in range(families)]
    out: list[VllmRequest] = []
    t = 0.0
    for i in range(n):
        family = i % families
        repeat_of = None
        if i >= families * 2 and rng.random() < 0.2:
            earlier = rng.choice(out)
            prompt, family, repeat_of = earlier.prompt, earlier.family, earlier.index
        else:
            suffix = tuple(rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randrange(1, 3 * BLOCK_TOKENS)))
            prompt = (prefixes[family] if rng.random() < 0.75 else ()) + suffix
        if i > burst:
            t += spacing
        # The burst decodes long, so it stays in D's queue for seconds (heartbeats).
        max_tokens = rng.randrange(160, 224) if i < burst else rng.randrange(8, 32)
        out.append(VllmRequest(index=i, prompt=prompt, max_tokens=max_tokens, arrival=t,
                               family=family, repeat_of=repeat_of,
                               late=bool(late_every) and i % late_every == late_every - 1, burst=i < burst))
    return out
