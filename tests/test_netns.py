"""``kvplane run --hosts netns``: P and D in network namespaces of their own on
a bridge, NIXL (UCX over TCP) and the side channel across the veths, as a user
runs it; a link-down partition; two decode engines, one killed; and nothing
left behind (namespaces, veths) after a run, a failed start or SIGTERM.

These need root (CI runs as root): where namespaces cannot be made the runs
exit 2 and the tests fail, they do not skip."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvplane.app.job import netns
from kvplane.app.job.options import rate
from kvplane.statemachines.replay import replay

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "NIXL_LOG_LEVEL": "ERROR"}
HELD_ZERO = re.compile(r"blocks still held P / D\s*│\s*0 / 0\s*│")


def kvplane_run(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``kvplane run --hosts netns`` (its pid names its namespaces)."""
    cmd = [sys.executable, "-m", "kvplane.app.cli", "run", "--hosts", "netns", "--out", str(tmp_path),
           "--startup-timeout", "600", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid


def assert_nothing_left(pid: int) -> None:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{netns.PREFIX}{pid}-" not in names, names
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert f"kvp{pid % 10**7}" not in links, links


def assert_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert HELD_ZERO.search(done.stdout), done.stdout[-4000:]


@pytest.mark.e2e
def test_netns_run_moves_kv_across_the_veth(tmp_path):
    done, pid = kvplane_run(tmp_path, "--requests", "8", "--quiet")
    assert_ok(done)
    assert_nothing_left(pid)
    summary = json.loads((tmp_path / "summary.json").read_text())
    hosts = summary["hosts"]
    assert hosts["kind"] == "netns" and hosts["P"]["netns"] != hosts["D"]["netns"]
    # The engines could only reach each other over the veth: every byte D read crossed it.
    assert summary["bytes_verified"] > 0 and summary["checks"]["all_turn1_ok"]


@pytest.mark.e2e
def test_rate_limited_link(tmp_path):
    """A 100 Mbit/s tbf on every veth: the run is slower, not wrong."""
    done, pid = kvplane_run(tmp_path, "--requests", "8", "--rate-limit", "100mbit", "--quiet")
    assert_ok(done)
    assert_nothing_left(pid)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["hosts"]["rate_limit_bits"] == 100_000_000
    # 100 Mbit/s is 12.5 MB/s: no READ may have gone faster than the link (allowing the bucket's burst).
    reads = summary["data_path"]["reads"]
    assert reads and reads["gbps"] < 0.05, reads


@pytest.mark.e2e
def test_partition_p_reclaims_within_the_lease(tmp_path):
    """Link down on both ends from 3 s to 15 s while requests keep arriving:
    the leases whose reads or heartbeats the partition cut expire within the
    lease term (6 s) plus slack; nothing is held at the end."""
    done, pid = kvplane_run(tmp_path, "--requests", "16", "--partition-at", "3", "--partition-for", "12",
                            "--quiet")
    assert_ok(done)
    assert_nothing_left(pid)
    summary = json.loads((tmp_path / "summary.json").read_text())
    [part] = summary["partitions"]
    assert part["leases_expired"] > 0, part  # the partition stranded leases, and P freed them
    assert part["within_bound"] and part["reclaim_s"] <= part["lease_s"] + part["slack_s"], part
    assert summary["checks"]["p_reclaimed_within_lease_after_partition"]
    assert summary["checks"]["no_corrupt_bytes"]


@pytest.mark.e2e
def test_two_decode_engines_one_killed(tmp_path):
    """Two decode engines behind the proxy; one is killed for good at 4 s and
    the other carries on: nothing is held at the end, by P or the survivor,
    and P's machines evicted the dead engine within engine_ttl (10 s here),
    before the end of the run, as replay of P's log counts it."""
    # P knows a decoder only once it read (or declined to read) its hold for a turn 2: with 48
    # requests (seed 0) decode-1's first held turn 1 (req0007, a late turn 2: 3.5 s after it) is
    # turned 2 at about 5.7 s, so the kill comes at 8 s.
    done, pid = kvplane_run(tmp_path, "--requests", "48", "--decode-engines", "2", "--kill-decode-at", "8",
                            "--engine-ttl", "10", "--quiet")
    assert_ok(done)
    assert_nothing_left(pid)
    summary = json.loads((tmp_path / "summary.json").read_text())
    engines = {e["role"]: e for e in summary["decode_engines"]}
    assert engines["D1"]["killed"] and not engines["D"]["killed"] and engines["D"]["held_blocks"] == 0
    assert (engines["D"]["outcomes"] or {}).get("ok", 0) > 0  # the survivor served requests
    assert {r["decoder"] for r in summary["requests_detail"] if r["decoder"]} == {"D", "D1"}  # round robin
    assert summary["checks"]["p_reclaimed_within_bound"]
    assert any(r["decoder"] == "D1" and r["turn2"] not in (None, "skipped") for r in summary["requests_detail"]), \
        "no turn 2 went to decode-1's hold before the kill: P never connected to it, nothing to evict"
    evicted = summary["fault"]["p_evicted"]
    assert evicted["engine"] == "decode-1" and evicted["within_bound"], evicted
    assert evicted["after_kill_s"] and max(evicted["after_kill_s"]) <= evicted["bound_s"] and evicted["at_shutdown"] == 0
    assert summary["checks"]["p_evicted_killed_engine"]
    assert re.search(r"P evicted the killed decode-1 after.*│\s*[0-9.]+", done.stdout), done.stdout[-3000:]
    # The summary's evictions are the machines' own, as replay of P's log finds them.
    assert replay(summary["logs"]["P"]).evictions == summary["evictions"]["P"]
    assert re.search(r"engines evicted\s*│\s*\d+ \(", done.stdout), done.stdout[-3000:]


@pytest.mark.e2e
def test_a_restarted_decode_engine_is_a_new_incarnation(tmp_path):
    """decode-1 is killed at 4 s and started again (same engine id, a new
    process and NIXL agent) in its namespace: the proxy routes to it again,
    the leases of its old incarnation's reads expire (the new one consumes
    none of them), and nothing is held at the end."""
    done, pid = kvplane_run(tmp_path, "--requests", "24", "--decode-engines", "2", "--restart-decode-at", "4",
                            "--quiet")
    assert_ok(done)
    assert_nothing_left(pid)
    summary = json.loads((tmp_path / "summary.json").read_text())
    fault = summary["fault"]
    assert fault["kind"] == "restart" and fault["back_at_s"] > fault["at_s"]
    assert fault["old_incarnation_leases"]["consumed_after"] == []
    assert summary["checks"]["old_incarnation_leases_not_consumed"] and summary["checks"]["restarted_engine_came_back"]
    after = [r for r in summary["requests_detail"] if r["decoder"] == "D1" and r["arrive"] > fault["back_at_s"]]
    assert any(r["turn1"] == "ok" for r in after), "the new incarnation served nothing"


@pytest.mark.e2e
def test_two_prefill_engines_each_in_its_namespace_through_a_partition(tmp_path):
    """Two prefill engines (each its own namespace on the bridge) and one
    decode engine: requests alternate over P and P1, D handshakes with and
    reads from the P that prefilled each (its engine id in the params), a
    turn 2 goes back to its turn 1's P; both Ps' links go down from 3 s to
    11 s: the leases it stranded, on either P, are freed within the lease
    term; nothing is held by either P or D, every event log replays."""
    done, pid = kvplane_run(tmp_path, "--requests", "16", "--prefill-engines", "2", "--partition-at", "3",
                            "--partition-for", "8", "--quiet")
    assert_ok(done)
    assert_nothing_left(pid)
    summary = json.loads((tmp_path / "summary.json").read_text())
    hosts = summary["hosts"]
    assert len({hosts[r]["netns"] for r in ("P", "P1", "D")}) == 3
    engines = {e["role"]: e for e in summary["prefill_engines"]}
    assert set(engines) == {"P", "P1"} and [engines[r]["engine_id"] for r in ("P", "P1")] == ["prefill-0", "prefill-1"]
    for e in engines.values():  # each served its half, holds nothing, and D consumed some of its leases
        assert e["requests"] == 8 and e["held_blocks"] == 0 and e["leases_consumed"] > 0, e
    assert summary["blocks_held"] == {"P": 0, "D": 0}
    assert {r["prefiller"] for r in summary["requests_detail"]} == {"P", "P1"}
    # D read from both, each from its own namespace's address.
    d_log = Path(summary["logs"]["D"]).read_text()
    assert "prefill-0/tp0" in d_log and "prefill-1/tp0" in d_log
    [part] = summary["partitions"]
    assert part["within_bound"] and summary["checks"]["p_reclaimed_within_lease_after_partition"], part
    assert summary["checks"]["no_corrupt_bytes"]
    assert set(summary["logs"]) == {"P", "P1", "D"}
    for log in summary["logs"].values():
        assert replay(log).ok, log


@pytest.mark.e2e
def test_sigterm_removes_the_namespaces(tmp_path):
    cmd = [sys.executable, "-m", "kvplane.app.cli", "run", "--hosts", "netns", "--out", str(tmp_path),
           "--requests", "400", "--quiet", "--startup-timeout", "600"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            if f"{netns.PREFIX}{proc.pid}-d" in names:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the run made no namespaces in 120 s")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert_nothing_left(proc.pid)


def test_leftovers_of_a_dead_run_are_removed():
    """A namespace named for a run whose process is gone (a SIGKILLed parent)
    is removed by the next run; another live run's namespaces are not."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-p"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in netns.remove_leftovers()
        assert stale not in netns.namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_the_root_namespace_reaches_the_hosts_through_its_own_veth():
    """``reach_from_root`` (the vLLM job's proxy): a server inside P's
    namespace, bound to P's veth address, answers this process in the root
    namespace; the root's veth goes with the namespaces."""
    with netns.HostNet(roles=("P", "D")) as hosts:
        root = hosts.reach_from_root()
        p = hosts.hosts["P"]
        assert root.endswith(".254") and root.rsplit(".", 1)[0] == p.address.rsplit(".", 1)[0]
        server = subprocess.Popen(["ip", "netns", "exec", p.netns, sys.executable, "-m", "http.server", "18765",
                                   "--bind", p.address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline, status = time.monotonic() + 30, None
            while status is None and time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://{p.address}:18765/", timeout=1) as resp:
                        status = resp.status
                except OSError:
                    time.sleep(0.1)
            assert status == 200
        finally:
            server.terminate()
            server.wait(timeout=10)
    assert_nothing_left(hosts.pid)


def test_failed_start_leaves_nothing(monkeypatch):
    """A failure while the pair is made (here: the veth) removes what was made."""
    pair = netns.HostNet()
    real = netns._ip

    def failing(*args: str, check: bool = True):
        if "veth" in args:
            raise netns.NetnsUnavailable("veth refused (test)")
        return real(*args, check=check)

    monkeypatch.setattr(netns, "_ip", failing)
    with pytest.raises(netns.NetnsUnavailable):
        with pair:
            pass
    monkeypatch.setattr(netns, "_ip", real)
    assert_nothing_left(pair.pid)


def test_not_root_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetnsUnavailable, match="needs root"):
        netns.check_available()


@pytest.mark.parametrize("args, says", [
    (["--ucx-net-devices", "nosuchdev0"], "no interface 'nosuchdev0'"),
    (["--side-channel-host", "192.0.2.7"], "cannot bind 192.0.2.7"),
    (["--advertise-host", "0.0.0.0"], "wildcard"),
    (["--rate-limit", "fast"], "not a rate"),
    (["--partition-at", "3", "--partition-for", "2"], "need --hosts netns"),
    (["--hosts", "netns", "--partition-at", "3"], "go together"),
    (["--hosts", "netns", "--side-channel-host", "127.0.0.1"], "drop --side-channel-host"),
    (["--prefill-engines", "0"], "--prefill-engines: must be >= 1, got 0"),
    (["--prefill-engines", "-1"], "--prefill-engines: must be >= 1, got -1"),
    (["--prefill-engines", "nan"], "--prefill-engines: not an integer: 'nan'"),
    (["--prefill-engines", "9"], "--prefill-engines must be in 1..8, got 9"),
    (["--engine", "vllm", "--prefill-engines", "0"], "--prefill-engines: must be >= 1, got 0"),
])
def test_bad_placement_options_exit_2(args, says):
    done = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "run", *args, "--quiet"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert says in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_rate_parses_tc_units():
    assert rate("200mbit") == 200_000_000 and rate("1.5gbit") == 1_500_000_000 and rate("800kbit") == 800_000
