"""The scheduler half of kvplane's vLLM connector, without vLLM.

vLLM calls it with its ``Request`` objects (read here by attribute:
``request_id``, ``kv_transfer_params``, ``num_prompt_tokens``,
``num_computed_tokens``, ``status``); it validates the params, translates
each call into the ``ConnectorScheduler``'s (whose ``engine_request``
machine keeps every request's lifecycle: this module keeps none) and hands
the workers one ``SchedulerStep`` per engine step.  What vLLM's request
lifecycle means for the plane, path by path (the machine's table):

- D, remote KV, tokens to load: awaited; vLLM keeps the request in
  WAITING_FOR_REMOTE_KVS until the workers report the recv (a failed one
  is reported finished too, and failed).
- D, full prefix hit (nothing to load): not awaited; the worker tells P
  to free at once and vLLM runs the request.
- D, aborted before its blocks were allocated: the same notify, so P frees
  now rather than when its lease runs out; vLLM is never told (it awaits
  nothing).
- D, aborted while its recv is awaited: the recv is aborted and still
  reported (failed), which is when vLLM frees the blocks.
- P, finished normally: the blocks go under a lease, freed when every
  reader is done or the lease expires (``finished_sending``); finished any
  other way (aborted, error): freed now.
- Bidirectional (``bidirectional_kv_xfer``): D holds a read request's
  blocks for ``decoder_kv_blocks_ttl`` and returns NixlConnector's
  ``do_remote_decode`` params for them; the next turn goes to P with those
  params: P reads the whole blocks of the held prefix (the expiry gate
  decides; declined or refused: P computes it), computes the rest and
  serves D's read-back like any prefill.  A read of fewer tokens than
  ``kv_recompute_threshold`` (64; NixlConnector's default, which it too
  applies to this read only) is declined: P computes them and tells D to
  free its hold at once (notify only, as a full prefix hit).

Bad params from a proxy never reach the plane: the request is counted,
logged (rate-limited), and computed locally.  With a deployment secret
(``settings.keys``) P signs the params it hands out and D acts only on
params whose signature verifies, made for its own prompt, naming exactly
the blocks of its tokens, and not used here before (``param_auth``).
"""
from __future__ import annotations

import os
import re
import time
from collections import Counter
from typing import Any, Callable, TextIO

import attrs

from .kv_dump import DUMP_KEY, DumpKV, tag_problem
from .kv_groups import ONE_GROUP, Groups, KvGroups, interleave, local_for, paired, without_null
from .param_auth import ConsumedLeases, RefusedParams, Vouched, check_for_request, prompt_digest, sign, verify
from .params import BadTransferParams, RemoteKV
from .prefill_backoff import tokens_to_read, truncate_for_prefill
from kvplane.statemachines import engine_calls as C
from kvplane.statemachines.eventlog import EventLogWriter
from kvplane.statemachines.machines.engine_request import EngineState

from .engine_report import EngineReport
from .records import RankInfo, StepMeta, WorkerReport
from .scheduler import ConnectorScheduler
from .vllm_params import TRANSFER_MODE, from_vllm, to_vllm
from .vllm_push import receive_params, serve_params
from .vllm_settings import VllmSettings

# vLLM's RequestStatus names of a request that finished producing output.
FINISHED_NORMALLY = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
# Refusals logged: the first few, then every this many-th (a flood costs a count).
LOG_EVERY = 1000
# Counts the scheduler half reports to vLLM's stats (vllm_stats.COUNT_KEYS).
STAT_KEYS = ("kvplane_refused_params", "kvplane_refused_dump_tags", "kvplane_unpaired_groups")
# How often the scheduler's event log is written out (seconds; at most once a step).
LOG_FLUSH_EVERY_S = 0.2


# A rank field of a log template, with the word naming it (``rank{rank}``,
# ``rank_{rank}``, ``tp{rank}``): the scheduler half is no rank.
_RANK_FIELD = re.compile(r"(?:rank|tp)[-_]?\{rank\}", re.IGNORECASE)


def scheduler_log_path(template: str) -> str:
    """The scheduler half's event log beside the ranks' (``kvplane_event_log``):
    ``{rank}``, with a ``rank``/``tp`` word before it, as ``scheduler``
    (``prefill.rank{rank}.events.jsonl``: ``prefill.scheduler.events.jsonl``),
    or ``.scheduler`` before the extension."""
    if "{rank}" in template:
        return _RANK_FIELD.sub("scheduler", template).replace("{rank}", "scheduler")
    stem, ext = os.path.splitext(template)
    return f"{stem}.scheduler{ext}"


@attrs.frozen
class Accepted:
    """A reader's accepted params: what it registers."""

    params: dict[str, Any]  # in the engine's transfer mode
    # Those params parsed; its remote_public_key is the key P's side channel must prove (None unsigned).
    remote: RemoteKV
    groups: Groups  # a hybrid model's remote lists per group (empty: one group)


@attrs.frozen
class SchedulerStep:
    """What the workers get each step: the plane's records and the dumps."""

    meta: StepMeta
    dumps: tuple[DumpKV, ...] = ()


class VllmSchedulerSide:
    def __init__(self, engine_id: str, settings: VllmSettings, *, tp_size: int = 1, block_size: int = 16,
                 warn: Callable[..., None] = lambda *a: None, transfer_mode: str = TRANSFER_MODE,
                 groups: KvGroups = ONE_GROUP, replicated_kv: bool = False, pp_size: int = 1,
                 prefill_backoff: int = 0):
        """``block_size``: tokens per KV block (vLLM's cache block size): D
        checks that P's block list covers exactly the tokens to load.
        ``groups``: the model's KV cache groups (a hybrid model's several:
        ``kv_groups``; the plane gets one flat list of them).
        ``transfer_mode``: "pull" (D READs) or "push" (D registers its
        blocks, P WRITEs: ``vllm_push``), the engine's connector class's.
        ``replicated_kv``: every rank holds the whole KV (MLA).  ``pp_size``:
        pipeline stages (ranks stage x TP + tp rank; such an engine serves reads only).
        ``prefill_backoff``: trailing prompt tokens P leaves for D to compute
        (a multi-module MTP drafter's lookahead: ``prefill_backoff``)."""
        self.settings = settings
        self.transfer_mode = transfer_mode
        self.push = transfer_mode == "push"
        self.sched = ConnectorScheduler(engine_id, tp_size=tp_size, config=settings.plane,
                                        host=settings.side_channel_host, replicated_kv=replicated_kv,
                                        pp_size=pp_size)
        self.block_size = block_size
        self.prefill_backoff = prefill_backoff
        self.groups = groups
        self.warn = warn
        self.consumed = ConsumedLeases()
        self._last_stats: tuple[int, ...] = (0,) * len(STAT_KEYS)
        self._dumps: list[DumpKV] = []  # this step's, for the workers
        self.counters: Counter = Counter()
        # What the scheduler half told the engine at the last step (for tests and debugging; vLLM acts on
        # the workers' own sets).
        self.last_report = EngineReport()
        # The engine's calls as its machines took them (kvplane_event_log).
        self._log_stream: TextIO | None = None
        self.log_writer: EventLogWriter | None = None
        self._log_flushed_at = 0.0
        if settings.event_log is not None:
            self._log_stream = open(scheduler_log_path(settings.event_log), "w", encoding="utf-8")
            self.log_writer = EventLogWriter.attach(self.sched.plane, self._log_stream, flush_every=4096)
            self._log_stream.flush()

    # ------------------------------------------------------------ start-up
    def add_ranks(self, infos: dict[int, RankInfo]) -> None:
        for info in infos.values():
            self.sched.add_rank(info)

    # ------------------------------------------------------------ requests
    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not params or not isinstance(params, dict):
            return
        remote = bool(params.get("do_remote_prefill"))
        # NixlConnector's turn 2: do_remote_decode with a decoder's held blocks.
        turn2 = (not remote and self.settings.bidirectional and bool(params.get("do_remote_decode"))
                 and bool(params.get("remote_block_ids")))
        if params.get("do_remote_decode") and not remote and \
                truncate_for_prefill(request, self.prefill_backoff, self.block_size):
            # P computes, and offers, the prompt less the backoff: D computes the rest.
            self.counters["prompts_backed_off"] += 1
        try:
            if remote or turn2:
                accepted = self._accept(request, params, turn2=turn2)
                self.sched.on_new_request(request.request_id, accepted.params, remote=accepted.remote,
                                          serve=turn2, remote_groups=accepted.groups,
                                          recompute_below=self.settings.kv_recompute_threshold if turn2 else 0)
            else:
                # Only the engine decides push or pull (a client's "push" key is not read).
                self.sched.on_new_request(request.request_id, serve_params(params, push=self.push))
        except BadTransferParams as exc:
            self._refused(request, exc, turn2)
            return
        except Exception as exc:  # the last line: one request's params never stop the engine
            self.counters["bad_transfer_params"] += 1
            self._refuse("kvplane_refused_params", "kvplane: request %s: unexpected %s on its kv_transfer_params "
                         "(%s); its prompt is computed locally", request.request_id, type(exc).__name__, exc)
            self._serve_anyway(request, turn2)

    def _refused(self, request: Any, exc: BadTransferParams, turn2: bool) -> None:
        self.counters["bad_transfer_params"] += 1
        if isinstance(exc, RefusedParams):
            self.counters[f"refused_params: {exc.reason}"] += 1
        self._refuse("kvplane_refused_params", "kvplane: request %s: %s; its prompt is computed locally",
                     request.request_id, exc)
        self._serve_anyway(request, turn2)

    def _serve_anyway(self, request: Any, turn2: bool) -> None:
        """A next turn whose read was refused is still a prefill for a
        remote decode: P computes the whole prompt and serves D's read-back."""
        if turn2:
            self.counters["turn2_refused_computed"] += 1
            self.sched.on_new_request(request.request_id, {"do_remote_decode": True})

    def _accept(self, request: Any, params: dict, *, turn2: bool = False) -> Accepted:
        """What D registers for its remote prefill, or P for its read of a
        decoder's hold (``turn2``); BadTransferParams when refused.  With a
        deployment secret only P's signed fields are read."""
        if params.get("do_remote_decode") and not turn2:
            raise BadTransferParams("kv_transfer_params: do_remote_prefill and do_remote_decode both set")
        translated = from_vllm(params, transfer_mode=self.transfer_mode, groups=self.groups.count)
        if turn2 and translated.get("remote_renewable") is not False:
            raise RefusedParams("not a decoder's hold", "do_remote_decode params name a renewable lease")
        keys = self.settings.keys
        # P's params name P's blocks (its --block-size); a turn 2 reads D's hold, in this engine's.
        remote_block = self.block_size if turn2 else self.settings.remote_block_size or self.block_size
        if keys is None:
            # Unauthenticated (kvplane_insecure or per-engine keypairs): still
            # the block list must cover exactly the prompt's (or, on a next
            # turn, the held prefix's) tokens.
            tokens = translated.get("remote_num_tokens")
            blocks = translated.get("remote_block_ids")
            count = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0
            fits = 0 < count <= request.num_prompt_tokens if turn2 else count == self._read_tokens(request) > 0
            groups: Groups = ()
            if self.groups.count > 1:
                problem = self.groups.cover_problem(blocks, count, self.block_size) if fits else "token count"
                if problem is not None:
                    raise RefusedParams("blocks do not cover the tokens", f"{problem}; the prompt has "
                                        f"{request.num_prompt_tokens} tokens, params {tokens!r}")
                translated, groups = _flatten(translated)
            elif not fits or not isinstance(blocks, list) or len(blocks) != -(-count // remote_block) or \
                    len(set(map(repr, blocks))) != len(blocks):
                raise RefusedParams("blocks do not cover the tokens",
                                    f"{_count(blocks)} blocks for {tokens!r} tokens; the prompt has "
                                    f"{request.num_prompt_tokens} (P backs off {self.prefill_backoff}), the "
                                    f"remote {remote_block} a block")
            if turn2:  # read as a remote prefill of the held prefix
                translated = self._whole_blocks(dict(translated, do_remote_prefill=True, do_remote_decode=False))
            return Accepted(params=receive_params(translated, push=self.push), remote=RemoteKV.from_dict(translated),
                            groups=groups)
        vouched = verify(translated, keys)
        check_for_request(vouched, prompt_token_ids=getattr(request, "prompt_token_ids", None),
                          num_prompt_tokens=request.num_prompt_tokens if turn2 else self._read_tokens(request),
                          block_size=remote_block, prefix=turn2,
                          groups=self.groups)
        registered = _registered(vouched)
        groups = ()
        if self.groups.count > 1:
            registered, groups = _flatten(registered)
        if turn2:
            registered = self._whole_blocks(registered)
        remote = RemoteKV.from_dict(registered, public_key=vouched.key.curve_public)  # before its lease name is spent
        self.consumed.consume(vouched.lease_name, vouched.term, self.sched.clock())
        return Accepted(params=receive_params(registered, push=self.push), remote=remote, groups=groups)

    def update_state_after_alloc_groups(self, request: Any, local: Groups, num_external_tokens: int) -> None:
        """A hybrid model's D: ``local`` is vLLM's new blocks per group (its
        unhashed ones); clipped as P clipped, each group's paired with P's
        from the end, flattened so the plane's tail pairing keeps them
        paired (``kv_groups.local_for``)."""
        remote = self.sched.remote_groups(request.request_id)
        if not remote or num_external_tokens <= 0 or not any(local):
            self.update_state_after_alloc(request, (), num_external_tokens)
            return
        clipped = self.groups.clip(local)
        flat = local_for(remote, clipped)
        if flat is None:  # not tails of one sequence: no flat list pairs them; the read brings nothing
            self._refuse("kvplane_unpaired_groups", "kvplane: request %s: its KV cache groups' blocks %s do not "
                         "pair with P's %s; nothing is read", request.request_id, local, remote)
            flat = ()
        self.update_state_after_alloc(request, flat, num_external_tokens, groups=paired(remote, clipped)[1])

    def _whole_blocks(self, registered: dict) -> dict:
        """A held prefix as P reads it: its whole blocks only (the last held
        block may be partly filled; P computes those tokens itself)."""
        whole = registered["remote_num_tokens"] // self.block_size
        if whole == 0:
            raise RefusedParams("held prefix shorter than a block")
        return dict(registered, remote_num_tokens=whole * self.block_size,
                    remote_block_ids=list(registered["remote_block_ids"])[:whole])

    def _read_tokens(self, request: Any) -> int:
        """The prompt tokens D reads from P: the prompt less P's backoff
        (params for any other count are refused)."""
        return tokens_to_read(request.num_prompt_tokens, self.prefill_backoff)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        # A turn-2 reader (P) reads the held prefix (the scheduler's read_tokens); D the prompt less the backoff.
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        prompt = self._read_tokens(request) if params.get("do_remote_prefill") else request.num_prompt_tokens
        tokens, load_async = self.sched.get_num_new_matched_tokens(rid, prompt, num_computed_tokens)
        if load_async and num_computed_tokens:
            self.counters["prefix_hits"] += 1
        return tokens, load_async

    def update_state_after_alloc(self, request: Any, block_ids: tuple[int, ...], num_external_tokens: int,
                                 groups: Groups = ()) -> None:
        """``block_ids``: the newly allocated blocks the remote tokens go into
        (vLLM: the unhashed blocks of the one group), empty when there is
        nothing to load.  vLLM calls again after the recv: the machine
        ignores it.  ``groups``: a hybrid model's blocks the read fills, per
        group (for the KV dump)."""
        out = self.sched.update_state_after_alloc(request.request_id, block_ids, num_external_tokens)
        if any(isinstance(a, C.SendLoad) for a in out):
            tag = self._dump_tag(request, request.kv_transfer_params or {})
            if tag is not None and block_ids:
                # What the read brings, saved when it is done, before D writes anything.
                self._dumps.append(DumpKV(request_id=request.request_id, tag=f"{tag}.recv", block_ids=block_ids,
                                          num_tokens=0, holds_blocks=False, when="recv", groups=groups))
        elif any(isinstance(a, C.SendNotifyOnly) for a in out):
            self.counters["full_prefix_hits"] += 1

    def build_step(self, scheduled_ids: list[str]) -> SchedulerStep:
        for rid in scheduled_ids:
            self.sched.request_running(rid)
        dumps: tuple[DumpKV, ...] = ()
        if self._dumps:
            dumps, self._dumps = tuple(self._dumps), []
        step = SchedulerStep(meta=self.sched.build_connector_meta(), dumps=dumps)
        now = time.monotonic()
        if self.log_writer is not None and now - self._log_flushed_at >= LOG_FLUSH_EVERY_S:
            self._log_flushed_at = now
            self.log_writer.flush()
        return step

    def shutdown(self) -> None:
        """Write out and close the event log."""
        if self.log_writer is not None:
            self.log_writer.close()
            self.log_writer = None
        if self._log_stream is not None:
            self._log_stream.close()
            self._log_stream = None

    def request_finished_groups(self, request: Any, groups: Groups) -> tuple[bool, dict[str, Any] | None]:
        """A hybrid model's request finished with ``groups`` (vLLM's block
        list per group): the plane leases the clipped groups' blocks (less
        the null block) as one flat list; the params name them per group,
        clipped as NixlConnector's."""
        clipped = self.groups.clip(groups)
        return self.request_finished(request, interleave(without_null(clipped)), groups=groups, clipped=clipped)

    def request_finished(self, request: Any, block_ids: tuple[int, ...], *, groups: Groups = (),
                         clipped: Groups | None = None) -> tuple[bool, dict[str, Any] | None]:
        """``groups``/``clipped``: a hybrid model's whole and clipped per-group
        lists (``block_ids`` flattens the clipped ones; the KV dumps name the
        whole ones)."""
        rid = request.request_id
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        status = request.status
        normal = (status.name if hasattr(status, "name") else str(status)) in FINISHED_NORMALLY
        inst = self.sched.request(rid)
        if inst is None:  # no remote KV (or refused params): vLLM frees as usual
            return self._maybe_dump(request, block_ids, params, normal, groups=groups)
        state, first, context = inst.state, inst.local_hit, inst.context
        read_ok = inst.recv_ok is not False
        reader_tp = self.settings.reader_tp
        if context is None or context.remote is None:  # P: a lease for the reader, finished normally with blocks
            delay, out = self.sched.request_finished(rid, block_ids, reader_tp=reader_tp,
                                                     normal=self._offers_its_prompt(request, block_ids, normal))
            if out is None:
                return False, None
            self._maybe_dump(request, block_ids, params, normal, holds_blocks=False, groups=groups)  # the lease holds them
            return delay, self._vouch(request, out, clipped)
        if state == EngineState.QUEUED:
            # Aborted before it was scheduled: the ranks tell P to free now; vLLM awaits nothing.
            self.counters["aborted_before_alloc"] += 1
        elif state in (EngineState.AWAITING_RECV, EngineState.OVERDUE):
            # Still awaited: the recv is aborted and reported (failed); vLLM frees the blocks then.
            self.counters["aborted_awaited_recv"] += 1
        if context.serve:
            # P's next turn: its read is over; it serves D's read-back like a prefill.
            delay, out = self.sched.request_finished(rid, block_ids, reader_tp=reader_tp,
                                                     normal=self._offers_its_prompt(request, block_ids, normal))
            if out is None:
                return False, None
            self._maybe_dump(request, block_ids, params, normal, holds_blocks=False, first_read_token=first,
                             read_ok=read_ok, groups=groups)
            return delay, self._vouch(request, out)
        hold = self.settings.bidirectional and normal
        held = self._held_blocks(request, block_ids) if hold else block_ids
        delay, out = self.sched.request_finished(rid, held, hold_for_next_turn=hold, reader_tp=reader_tp,
                                                 normal=normal)
        if out is not None:
            self._maybe_dump(request, block_ids, params, normal, first_read_token=first, read_ok=read_ok,
                             holds_blocks=False, groups=groups)
            self._dump_hold(request, held, params)
            return delay, self._vouch(request, out)
        if state not in (EngineState.RECV_DONE, EngineState.RECV_FAILED, EngineState.RUNNING, EngineState.LOCAL):
            return False, None  # its recv never ran, or is aborted now: nothing to dump
        return self._maybe_dump(request, block_ids, params, normal, first_read_token=first, read_ok=read_ok,
                               groups=groups)

    def _offers_its_prompt(self, request: Any, block_ids: tuple[int, ...], normal: bool) -> bool:
        """Whether P leases its blocks to a reader: finished normally, with
        blocks, and holding its whole prompt's KV.  vLLM finishes a request
        only after its last prefill chunk (a middle chunk samples nothing),
        so ``num_computed_tokens`` is then the prompt, preempted or not; a
        request that ends short of it is not offered (fail closed: its
        blocks are freed now, the reader computes the prompt), since params
        for fewer tokens than the prompt are params no reader accepts."""
        if not (normal and block_ids):
            return False
        if request.num_computed_tokens < request.num_prompt_tokens:
            self.counters["partial_prefill_not_offered"] += 1
            return False
        return True

    def _held_blocks(self, request: Any, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The blocks of the tokens D computed (the ones its hold vouches for):
        exactly ``ceil(num_computed_tokens / block_size)``."""
        return tuple(block_ids[:-(-request.num_computed_tokens // self.block_size)])

    def _dump_hold(self, request: Any, held: tuple[int, ...], params: dict) -> None:
        """With a dump tag: the held whole blocks' KV as ``<tag>.hold`` (what
        the next turn's reader reads, for the KV check)."""
        tag = self._dump_tag(request, params)
        whole = request.num_computed_tokens // self.block_size
        if tag is None or whole == 0:
            return
        self._dumps.append(DumpKV(request_id=request.request_id, tag=f"{tag}.hold", block_ids=held[:whole],
                                  num_tokens=whole * self.block_size, holds_blocks=False))

    def _maybe_dump(self, request: Any, block_ids: tuple[int, ...], params: dict, normal: bool, *,
                    holds_blocks: bool = True, first_read_token: int = 0,
                    read_ok: bool | None = None, groups: Groups = ()) -> tuple[bool, dict[str, Any] | None]:
        """A request tagged ``kvplane_dump_kv`` (with a dump folder set) has
        its prompt's KV saved (a hybrid model's ``groups`` named per group);
        (delay the free, params) for vLLM."""
        tag = self._dump_tag(request, params) if normal and block_ids else None
        if tag is None:
            return False, None
        self._dumps.append(DumpKV(request_id=request.request_id, tag=tag, block_ids=block_ids,
                                  num_tokens=request.num_prompt_tokens, holds_blocks=holds_blocks,
                                  first_read_token=first_read_token, read_ok=read_ok, groups=groups))
        return holds_blocks, None

    def _vouch(self, request: Any, out: dict[str, Any], clipped: Groups | None = None) -> dict[str, Any]:
        """The params for the reader in vLLM's shape, signed with the
        deployment secret over the tokens the blocks hold (unsigned when
        there is none: kvplane_insecure, or token ids P does not have,
        which a reader with the secret then refuses)."""
        num_tokens = request.num_computed_tokens
        params = to_vllm(out, num_tokens=num_tokens, transfer_mode=self.transfer_mode, groups=clipped)
        keys = self.settings.keys
        if keys is None:
            return params
        token_ids = getattr(request, "all_token_ids", None)
        if token_ids is None or getattr(request, "prompt_token_ids", None) is None:
            self.counters["params_unsigned_no_token_ids"] += 1
            return params
        try:
            digest = prompt_digest(list(token_ids)[:num_tokens])
        except ValueError:
            self.counters["params_unsigned_no_token_ids"] += 1
            return params
        # The scheduler stated expiry = its clock at the grant + the term.
        plane = self.settings.plane
        issued = out["remote_expiry"] - (plane.kv_lease_duration if out.get("remote_renewable")
                                         else plane.decoder_kv_blocks_ttl)
        return sign(params, prompt_sha256=digest, issued=issued, key=keys.signing)

    def _dump_tag(self, request: Any, params: dict) -> str | None:
        """The request's dump tag if it asks for a dump that may be made (a
        dump folder is set and the tag is a plain name); a bad tag is a
        counted, logged refusal."""
        tag = params.get(DUMP_KEY)
        if tag is None or not self.settings.kv_dump_dir:
            return None
        problem = tag_problem(tag)
        if problem is not None:
            self._refuse("kvplane_refused_dump_tags", "kvplane: request %s: KV dump refused: %s",
                         request.request_id, problem)
            return None
        return tag

    def _refuse(self, counter: str, fmt: str, *args: Any) -> None:
        """Count a refusal; log the first few, then every LOG_EVERY-th."""
        n = self.counters[counter] = self.counters[counter] + 1
        if n <= 10 or n % LOG_EVERY == 0:
            self.warn(f"{fmt} (%s #%d)", *args, counter, n)

    def has_pending_push_work(self) -> bool:
        """Push mode, P: leased blocks whose WRITE is not over keep the
        engine stepping (vLLM's hook), so their end reaches vLLM at once."""
        return self.push and self.sched.pushes_pending()

    def stats(self) -> dict[str, int]:
        """The scheduler half's counts since the last call (vLLM's
        scheduler-side get_kv_connector_stats)."""
        counters = self.counters
        now = tuple([counters.get(k, 0) for k in STAT_KEYS])
        last, self._last_stats = self._last_stats, now
        if now == last:  # most steps
            return {}
        return {k: n - was for k, n, was in zip(STAT_KEYS, now, last) if n != was}

    # ------------------------------------------------------------ worker results
    def update_from_workers(self, reports: list[WorkerReport]) -> None:
        """One step's worker reports (vLLM: the aggregated worker meta): the
        machine's RecvFinished / SendingFinished once every rank reported.
        vLLM acts on the workers' own sets (its aggregator); the scheduler's
        engine-level report (the main job's) is kept as ``last_report``
        until the next step."""
        for report in reports:
            self.sched.update_from_worker(report)
        self.last_report = self.sched.get_finished()


def _registered(v: Vouched) -> dict[str, Any]:
    """What D registers of vouched params: the signed fields, nothing else."""
    return {"do_remote_prefill": True, **v.fields}


def _count(blocks: Any) -> str:
    return str(len(blocks)) if isinstance(blocks, list) else "no list of"


def _flatten(params: dict) -> tuple[dict, Groups]:
    """A hybrid model's checked per-group lists as the plane's one flat list
    (``kv_groups.interleave``), and the groups (less the null block), which
    stay with the request's machine for D's pairing at allocation."""
    groups = without_null(params["remote_block_ids"])
    return dict(params, remote_block_ids=list(interleave(groups))), groups
