"""``kvplane attack``: hostile requests straight to D's and P's OpenAI API.

Starts P and D as the vLLM job does (``vllm_run``: tiny local model, dummy
weights, kvplane's connector with keys, or vLLM's NixlConnector) and sends,
as anyone who can reach the engines' HTTP ports could, one class of hostile
input after another (issue 30's findings):

- ``a_out_of_range``: P's params for a prompt, block ids past P's cache;
- ``b_foreign`` / ``b_short`` / ``b_reversed`` / ``b_duplicated``: one's own
  valid params, with another request's block ids, one block of four, the
  list reversed, one block four times;
- ``c_replay``: params D already used, sent again with a later expiry after
  P freed (and reused) the blocks;
- ``d_address``: P's engine id with an attacker's host/port (a listener that
  accepts and never answers), a flood of them while a normal request runs;
- ``e_dump_path``: the ``kvplane_dump_kv`` tag ``../x`` and an absolute path;
- ``f_forged_completion``: a stranger (its own NIXL agent) fetches P's
  metadata from the side channel and sends P a completion for a live lease.

Each is judged by what an operator cares about: both engines still serve,
every hostile request got 200 or a clean 4xx, no foreign KV served (the
job's byte-for-byte KV check, ``kv_check``: what D read is P's KV of that
prompt, what D kept is D's own recompute, also for a later plain request of
the prompt), nothing held at the end (KV cache usage 0 on both; kvplane:
its status files), and kvplane's refusal counters.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import attrs

from kvplane.connector.kv_dump import DUMP_KEY

from .kv_check import verdict, _load
from .run import VllmRun, VllmRunOptions, _status, _usage
from .workload import BLOCK_TOKENS, VOCAB_HI, VOCAB_LO

# d first: D has not connected to P yet (a connected engine never handshakes again).
ATTACKS = ("d_address", "e_dump_path", "f_forged_completion", "c_replay", "b_foreign", "b_short", "b_reversed",
           "b_duplicated", "a_out_of_range")
PROMPT_BLOCKS = 4  # 4 whole blocks and a few tokens: D reads 4 blocks from P


@attrs.define
class Outcome:
    """One attack's result, as the side-by-side table shows it."""

    attack: str
    statuses: list = attrs.Factory(list)  # HTTP status of each hostile request (None: no answer)
    kv: str = "n/a"  # "ok", "FOREIGN: ...", "n/a"
    engines: str = ""  # "P up, D up" after the attack
    note: str = ""
    figures: dict = attrs.Factory(dict)  # what a test asserts on

    @property
    def clean(self) -> bool:
        return all(s is not None and (s == 200 or 400 <= s < 500) for s in self.statuses)


class Http:
    def __init__(self, url: str, model: str, timeout: float):
        self.url, self.model, self.timeout = url, model, timeout

    def complete(self, body: dict) -> tuple[int | None, dict | str]:
        """POST /v1/completions; (status, body or error text). Never raises."""
        data = json.dumps({"model": self.model, "temperature": 0.0, **body}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")[:300]
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            return None, str(exc)[:300]


class SilentListener:
    """The attacker's address: accepts TCP connections, never answers; counts them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for c in self._held:
            c.close()
        self.sock.close()


class Attacker:
    def __init__(self, run: VllmRun, connector: str, timeout: float, say: Callable[[str], None]):
        self.run, self.connector, self.say = run, connector, say
        model = str(run.model)
        self.p = Http(run.engines["P"].url, model, timeout)
        self.d = Http(run.engines["D"].url, model, timeout)
        self.dumps = run.dumps
        self.rng = random.Random(30)
        self._n = 0

    # ------------------------------------------------------------ helpers
    def prompt(self) -> list[int]:
        self._n += 1
        return [self.rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(PROMPT_BLOCKS * BLOCK_TOKENS + 5)]

    def prefill(self, prompt: list[int], tag: str) -> dict | None:
        """P computes the prompt and hands out params (its KV saved as ``tag.p``)."""
        status, body = self.p.complete({"prompt": prompt, "max_tokens": 1,
                                        "kv_transfer_params": {"do_remote_decode": True, DUMP_KEY: f"{tag}.p"}})
        return body.get("kv_transfer_params") if status == 200 and isinstance(body, dict) else None

    def decode(self, prompt: list[int], params: dict | None, tag: str | None, **extra: Any) -> int | None:
        kv = dict(params or {})
        if tag is not None:
            kv[DUMP_KEY] = tag
        status, _ = self.d.complete({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": kv or None, **extra})
        return status

    def reference(self, prompt: list[int], tag: str) -> None:
        """D computes the prompt from scratch (its own cache salt): ``tag.local``."""
        self.d.complete({"prompt": prompt, "max_tokens": 1, "cache_salt": f"ref-{tag}",
                         "kv_transfer_params": {DUMP_KEY: f"{tag}.local"}})

    def kv_verdict(self, tag: str) -> str:
        deadline = time.monotonic() + 10
        wanted = [self.dumps / f"{tag}{part}.rank0.pt" for part in ("", ".local")]
        while not all(p.exists() for p in wanted) and time.monotonic() < deadline:
            time.sleep(0.2)  # a dump is written by the worker, after the answer
        parts = [_load(self.dumps / f"{tag}{part}.rank0.pt") for part in ("", ".p", ".local", ".recv")]
        if parts[0] is None:
            return "no dump"
        v = verdict(tag, *parts)
        if v.ok:
            return "ok (read)" if v.read_tokens else "ok (recomputed)"
        return f"FOREIGN: {v.why}"

    def up(self, name: str) -> bool:
        """Running and answering /health (three tries over ~6 s: a busy CPU engine may miss one)."""
        e = self.run.engines[name]
        for _ in range(3):
            if not e.alive:
                return False
            if e.healthy():
                return True
            time.sleep(2.0)
        return False

    def engines(self) -> str:
        return ", ".join(f"{n} {'up' if self.up(n) else 'DOWN'}" for n in ("P", "D"))

    def alive(self) -> bool:
        return all(self.up(n) for n in ("P", "D"))

    def normal(self, tag: str, check: bool = False) -> tuple[int | None, float, str]:
        """A normal P/D request: (D's status, seconds, KV verdict if ``check``)."""
        prompt = self.prompt()
        t0 = time.monotonic()
        params = self.prefill(prompt, tag)
        status = self.decode(prompt, params, tag) if params is not None else None
        seconds = time.monotonic() - t0
        kv = "n/a"
        if check and status == 200:
            self.reference(prompt, tag)
            kv = self.kv_verdict(tag)
        return status, seconds, kv

    # ------------------------------------------------------------ attacks
    def a_out_of_range(self) -> Outcome:
        prompt = self.prompt()
        params = self.prefill(prompt, "a")
        out = Outcome("a_out_of_range")
        if params is None:
            return attrs.evolve(out, note="P gave no params")
        bad = dict(params, remote_block_ids=edit_blocks(params["remote_block_ids"], None,
                                                         lambda own, _: [4_000_000_000 + i for i in range(len(own))]))
        out.statuses.append(self.decode(prompt, bad, "a"))
        time.sleep(2.0)  # an engine core that died takes a moment to take the server down
        out.engines = self.engines()
        if self.alive():
            self.reference(prompt, "a")
            out.kv = self.kv_verdict("a")
        return out

    def _blocks_attack(self, name: str, edit: Callable[[list, list], list]) -> Outcome:
        """Own valid params for prompt A with the block list ``edit(own, victim's)``;
        then a plain request of A: is D's cached KV of A its own?"""
        victim, mine = self.prompt(), self.prompt()
        pv = self.prefill(victim, f"{name}.victim")
        pa = self.prefill(mine, name)
        out = Outcome(name)
        if pv is None or pa is None:
            return attrs.evolve(out, note="P gave no params")
        hostile = dict(pa, remote_block_ids=edit_blocks(pa["remote_block_ids"], pv["remote_block_ids"], edit))
        out.statuses.append(self.decode(mine, hostile, name))
        out.engines = self.engines()
        if not self.alive():
            return out
        # The same prompt again, plain (no params): served from D's prefix cache.
        out.statuses.append(self.decode(mine, None, f"{name}.after"))
        self.decode(victim, pv, f"{name}.victim")  # the victim's own request: its lease ends normally
        for tag in (name, f"{name}.after"):
            self.reference(mine, tag)
        self.reference(victim, f"{name}.victim")
        verdicts = {tag: self.kv_verdict(tag) for tag in (name, f"{name}.after", f"{name}.victim")}
        bad = {t: v for t, v in verdicts.items() if not v.startswith("ok")}
        out.kv = "ok" if not bad else "; ".join(f"{t}: {v}" for t, v in bad.items())
        return out

    def b_foreign(self) -> Outcome:
        return self._blocks_attack("b_foreign", lambda own, theirs: theirs)

    def b_short(self) -> Outcome:
        return self._blocks_attack("b_short", lambda own, theirs: own[-1:])

    def b_reversed(self) -> Outcome:
        return self._blocks_attack("b_reversed", lambda own, theirs: own[::-1])

    def b_duplicated(self) -> Outcome:
        return self._blocks_attack("b_duplicated", lambda own, theirs: own[:1] * len(own))

    def c_replay(self) -> Outcome:
        prompt = self.prompt()
        params = self.prefill(prompt, "c_replay")
        out = Outcome("c_replay")
        if params is None:
            return attrs.evolve(out, note="P gave no params")
        first = self.decode(prompt, params, "c_first")  # the legitimate use: P frees the blocks
        # P reuses its freed blocks for other prompts: three of 30 blocks fill
        # its 96-block pool, the free list's tail (where the freed ones went) too.
        for _ in range(3):
            filler = [self.rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(30 * BLOCK_TOKENS)]
            self.p.complete({"prompt": filler, "max_tokens": 1})
        replay = dict(params)
        if "remote_expiry" in replay and isinstance(replay["remote_expiry"], (int, float)):
            replay["remote_expiry"] = replay["remote_expiry"] + 3600.0
        # Its own cache salt: D has no block of it cached, so it reads them all.
        out.statuses.append(self.decode(prompt, replay, "c_replay", cache_salt="replay"))
        out.engines = self.engines()
        out.note = f"first use: {first}"
        if self.alive():
            self.d.complete({"prompt": prompt, "max_tokens": 1, "cache_salt": "replay-ref",
                             "kv_transfer_params": {DUMP_KEY: "c_replay.local"}})
            out.kv = self.kv_verdict("c_replay")
        return out

    def d_address(self, flood: int = 12) -> Outcome:
        out = Outcome("d_address")
        listener = SilentListener()
        try:
            hostile = []
            for k in range(flood):
                prompt = self.prompt()
                params = self.prefill(prompt, f"d{k}")
                if params is not None:
                    bad = dict(params, remote_host="127.0.0.1", remote_port=listener.port)
                    if "remote_rank_ports" in params:  # kvplane: each rank's side channel
                        bad["remote_rank_ports"] = [listener.port] * len(params["remote_rank_ports"])
                    hostile.append((prompt, bad))
            with ThreadPoolExecutor(max_workers=flood + 1) as pool:
                futures = [pool.submit(self.decode, prompt, params, None) for prompt, params in hostile]
                time.sleep(1.0)
                legit = pool.submit(self.normal, "d_legit")
                out.statuses = [f.result() for f in futures]
                legit_status, legit_s, _ = legit.result()
            baseline_status, baseline_s, _ = self.normal("d_baseline")
            out.engines = self.engines()
            out.figures = {"connections": listener.accepted, "legit_status": legit_status, "legit_s": legit_s,
                           "after_s": baseline_s}
            out.note = (f"{listener.accepted} connections to the attacker's port; a normal request meanwhile: "
                        f"{legit_status} in {legit_s:.1f} s (after: {baseline_status} in {baseline_s:.1f} s)")
            out.kv = "n/a"
        finally:
            listener.close()
        return out

    def e_dump_path(self) -> Outcome:
        out = Outcome("e_dump_path")
        outside = Path(f"/tmp/kvplane-attack-{random.randrange(1 << 30):x}")
        parent = self.dumps.parent / "x"
        written = []
        for tag in ("../x", str(outside)):
            status, _ = self.p.complete({"prompt": self.prompt(), "max_tokens": 1,
                                         "kv_transfer_params": {DUMP_KEY: tag}})
            out.statuses.append(status)
            status, _ = self.d.complete({"prompt": self.prompt(), "max_tokens": 1,
                                         "kv_transfer_params": {DUMP_KEY: tag}})
            out.statuses.append(status)
        time.sleep(1.0)
        for path in (Path(f"{parent}.rank0.pt"), Path(f"{outside}.rank0.pt")):
            if path.exists():
                written.append(str(path))
                path.unlink()
        out.engines = self.engines()
        out.figures = {"written": written}
        out.note = f"files written outside the dump folder: {written or 'none'}"
        return out

    def f_forged_completion(self) -> Outcome:
        out = Outcome("f_forged_completion")
        # The window judged is this attack's lease alone, well inside its life:
        # the stranger's NIXL is imported first (torch and NIXL: 6 s idle, up to
        # 30 s on two busy cores, which let the lease expire inside the window),
        # and earlier attacks' leases (d_address's twelve, never read) have
        # expired first, so no lawful expiry lowers the usage meanwhile.
        from kvplane.transport.nixl_agent import NixlEndpoint  # noqa: F401 (imported ahead of the window)

        settled = self.run.settle(["P"], self.run.opts.lease + 10.0)["P"]
        prompt = self.prompt()
        params = self.prefill(prompt, "f")
        if params is None:
            return attrs.evolve(out, note="P gave no params")
        start = time.monotonic()
        before = _usage(self.run.engines["P"].url)
        try:
            freed_by = forge_completion(self.connector, params)
        except Exception as exc:  # noqa: BLE001 (an attack that fails is a result)
            freed_by = f"not sent: {type(exc).__name__}: {str(exc)[:120]}"
        time.sleep(1.0)
        after = _usage(self.run.engines["P"].url)
        out.figures = {"usage_before": before, "usage_after": after, "forged": freed_by, "usage_settled": settled,
                       "window_s": round(time.monotonic() - start, 2), "lease_s": self.run.opts.lease}
        out.note = f"{freed_by}; P's KV cache usage {before:.4f} -> {after:.4f} before D read the lease"
        out.statuses.append(self.decode(prompt, params, "f"))
        out.engines = self.engines()
        if self.alive():
            self.reference(prompt, "f")
            out.kv = self.kv_verdict("f")
        return out


def edit_blocks(own: list, theirs: list | None, edit: Callable[[list, list], list]) -> list:
    """``edit(own ids, their ids)`` applied to a params' block list: one list
    of ids, or (vLLM's hybrid KV cache manager) one per KV cache group."""
    if own and isinstance(own[0], list):
        return [edit(list(g), list(t) if theirs is not None else []) for g, t in zip(own, theirs or own)]
    return edit(list(own), list(theirs or []))


def forge_completion(connector: str, params: dict) -> str:
    """As a stranger: fetch P's NIXL metadata from its side channel and send P
    the completion of the lease ``params`` name.  Returns what happened."""
    import msgpack
    import zmq

    from kvplane.transport.nixl_agent import NixlEndpoint

    url = f"tcp://{params['remote_host']}:{params['remote_port']}"
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(url)
    try:
        sock.send(msgpack.packb((b"get_meta_msg", 0, 0), use_bin_type=True))
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            return "side channel gave the stranger no metadata"
    finally:
        sock.close()
    if connector == "nixl":
        # NixlConnector's NixlHandshakePayload and NixlAgentMetadata: dataclasses, msgpack maps on the wire.
        payload = msgpack.unpackb(frames[0], raw=False)
        metadata = msgpack.unpackb(payload["agent_metadata_bytes"], raw=False)["agent_metadata"]
    else:
        from kvplane.transport.wire import unframe_metadata

        body = msgpack.unpackb(frames[0], raw=False)
        if not isinstance(body, dict) or "metadata" not in body:
            return f"side channel refused the stranger: {str(body)[:60]}"
        metadata = unframe_metadata(body["metadata"])
    stranger = NixlEndpoint(f"stranger-{random.randrange(1 << 30):x}")
    try:
        name = stranger.add_remote(metadata)
        stranger.send_notif(name, f"{params['remote_request_id']}:1".encode())
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # no progress thread: polling moves the send along
            stranger.poll_notifs()
            time.sleep(0.01)
    finally:
        stranger.close()
    return "stranger got the metadata and sent a completion"


# ---------------------------------------------------------------- the session
def run_attacks(connector: str, out: str, *, timeout: float = 120.0, startup_timeout: float = 420.0,
                attacks: tuple[str, ...] = ATTACKS, say: Callable[[str], None] = print) -> dict:
    """Start P and D with ``connector``, run ``attacks`` in one session, settle,
    stop; returns (and writes to ``out``/attack.json) the results."""
    opts = VllmRunOptions(connector=connector, out=out, requests=1, timeout=timeout,
                          startup_timeout=startup_timeout, quiet=True)
    run = VllmRun(opts, say)
    specs = run.prepare()
    result: dict[str, Any] = {"connector": connector, "attacks": []}
    try:
        result["startup_s"] = run.start(specs)
        attacker = Attacker(run, connector, timeout, say)
        status0 = _statuses(run)
        metrics0 = {n: run.metrics(n) for n in ("P", "D")}
        for name in attacks:
            if not attacker.alive():
                result["attacks"].append(attrs.asdict(Outcome(name, engines=attacker.engines(),
                                                              note="not run: an engine is down")))
                continue
            say(f"attack {name}")
            o = getattr(attacker, name)()
            say(f"  {o.statuses} kv={o.kv} {o.engines} {o.note}")
            result["attacks"].append({**attrs.asdict(o), "clean": o.clean})
        status, seconds, kv = attacker.normal("final", check=True) if attacker.alive() else (None, 0.0, "n/a")
        result["final_normal_request"] = {"status": status, "seconds": round(seconds, 2), "kv": kv}
        result["engines_end"] = attacker.engines()
        names = [n for n in ("P", "D") if run.engines[n].alive]
        result["usage_end"] = run.settle(names, opts.lease + 20.0)
        # The status files are the tickers' (every STATUS_EVERY_S): one from
        # before the settle may predate the last lease's release.
        status1 = _statuses(run, written_after=time.time(), timeout=10.0)
        result["refusals"] = _refusals(status0, status1)
        for n in names:  # the scheduler half's refusals reach vLLM's metrics, not the status files
            m0, m1 = metrics0[n], run.metrics(n)
            result["refusals"].update({f"{n}.{k}": m1[k] - m0.get(k, 0.0) for k in m1
                                       if "refused" in k and not k.endswith("_created") and m1[k] != m0.get(k, 0.0)})
        result["connector_held"] = {role: (s or {}).get("gauges", {}) for role, s in status1.items()}
    finally:
        result["exit_codes"] = run.stop()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "attack.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def _statuses(run: VllmRun, *, written_after: float = 0.0, timeout: float = 0.0) -> dict[str, dict | None]:
    """Each role's status file; with ``written_after`` (time.time()), waits
    up to ``timeout`` for files written since then (the last ones read are
    returned either way)."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = {role: _status(run.out / f"{role}.status.json") for role in ("prefill", "decode")}
        if all((s or {}).get("time", 0.0) > written_after for s in statuses.values()) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.2)


def _refusals(before: dict, after: dict) -> dict[str, int]:
    """kvplane's refusal and failure counters that moved during the attacks."""
    out: dict[str, int] = {}
    for role in after:
        c0 = (before.get(role) or {}).get("counts", {})
        c1 = (after.get(role) or {}).get("counts", {})
        for k, v in c1.items():
            if any(w in k for w in ("refused", "failed", "declined")) and v != c0.get(k, 0):
                out[f"{role}.{k}"] = v - c0.get(k, 0)
    return out


def table(results: dict[str, dict]) -> str:
    """Markdown: per attack, each connector's outcome."""
    names = list(results)
    head = "| attack | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    rows = []
    attacks = [a["attack"] for a in next(iter(results.values()))["attacks"]]
    for i, attack in enumerate(attacks):
        cells = []
        for n in names:
            a = results[n]["attacks"][i]
            statuses = ",".join("none" if s is None else str(s) for s in a["statuses"]) or "-"
            cells.append(f"HTTP {statuses}; {a['engines']}; KV {a['kv']}" + (f"; {a['note']}" if a["note"] else ""))
        rows.append(f"| {attack} | " + " | ".join(cells) + " |")
    tail = []
    for label, key in (("after all: normal request", "final_normal_request"), ("engines at the end", "engines_end"),
                       ("KV cache usage at the end", "usage_end"), ("kvplane counters moved", "refusals")):
        tail.append(f"| {label} | " + " | ".join(str(results[n].get(key)) for n in names) + " |")
    return head + "\n".join(rows + tail) + "\n"


def add_attack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connector", choices=("kvplane", "nixl", "both"), default="kvplane",
                   help="the connector both engines load; both: one session each, then the side-by-side table")
    p.add_argument("--out", default="runs/attack", metavar="DIR", help="engines' logs, dumps, attack.json")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S", help="per HTTP request")


def cmd_attack(args: argparse.Namespace) -> int:
    names = ("kvplane", "nixl") if args.connector == "both" else (args.connector,)
    results = {}
    try:
        for name in names:
            out = str(Path(args.out) / name) if len(names) > 1 else args.out
            results[name] = run_attacks(name, out, timeout=args.timeout)
    except RuntimeError as exc:
        print(f"kvplane attack: {exc}")
        return 1
    text = table(results)
    print(text)
    (Path(args.out) / "attack_table.md").write_text(text)
    kv = results.get("kvplane")
    if kv is None:
        return 0
    ok = kv["engines_end"] == "P up, D up" and all(
        a["clean"] and (a["kv"] == "n/a" or a["kv"].startswith("ok")) for a in kv["attacks"])
    return 0 if ok else 1
