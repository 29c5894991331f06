"""Data parallel (vLLM's --data-parallel-size) without an engine: the job's
options, its engines' command lines, and that every file a DP engine core's
connector writes has a name of its own that the job's report finds.

vLLM 0.32.0 runs a dense model's DP ranks as independent engine cores that
share one kv_transfer_config: each suffixes the engine id with ``_dp{k}`` and
tells its connector ``data_parallel_index = k`` (never the DP size).  The
engine runs are in tests/test_vllm_parity.py and docs/parity.md."""
from __future__ import annotations

import pytest

from kvplane.app.cli import build_parser, main
from kvplane.app.vllm.engines import UNBOUND, EngineSpec
from kvplane.app.vllm.run import VllmRun, log_name, options_from_args, rank_files, rank_stems
from kvplane.connector.vllm_settings import for_dp_rank, settings_from
from kvplane.statemachines.config import ConfigError


def _opts(*flags: str):
    return options_from_args(build_parser().parse_args(["run", "--engine", "vllm", *flags]))


@pytest.mark.parametrize("argv,words", [
    (["--decode-dp", "3"], "--decode-dp must be in 1..2, got 3"),
    (["--prefill-dp", "2", "--push"], "--prefill-dp and --decode-dp > 1 run with --model tiny, --prefill-tp 1"),
    (["--decode-dp", "2", "--bidirectional"], "without --push, --bidirectional"),
    (["--decode-dp", "2", "--kill-decode-at", "5"], "or --kill-decode-at"),
    (["--decode-dp", "2", "--prefill-tp", "2"], "--prefill-tp 1, --decode-tp 1"),
    (["--decode-dp", "2", "--model", "hybrid"], "--model tiny"),
    (["--prefill-dp", "2", "--prefill-engines", "2"], "one prefill engine"),
    (["--decode-dp", "2", "--decode-block-size", "64", "--prefill-block-size", "64"], "vLLM's block size"),
])
def test_unsupported_dp_combinations_are_refused_in_one_line(argv, words, capsys):
    assert main(["run", "--engine", "vllm", *argv]) == 2
    got = capsys.readouterr()
    assert len(got.err.splitlines()) == 1 and words in got.err and "Traceback" not in got.err, got.err


@pytest.mark.parametrize("argv,words", [
    (["run", "--decode-dp", "2"], "--decode-dp needs --engine vllm"),
])
def test_dp_is_a_vllm_option(argv, words, capsys):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_dp_0_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--engine", "vllm", "--prefill-dp", "0"])
    assert exc.value.code == 2
    assert "--prefill-dp: must be >= 1, got 0" in capsys.readouterr().err


def test_the_engine_command_asks_vllm_for_its_dp_size():
    spec = EngineSpec(name="D", engine_id="decode-0", http_port=1, side_channel_port=2, connector="kvplane", dp=2)
    cmd = spec.command("/m")
    assert cmd[cmd.index("--data-parallel-size") + 1] == "2"
    assert "--data-parallel-size" not in EngineSpec(name="P", engine_id="p", http_port=1, side_channel_port=2,
                                                    connector="kvplane").command("/m")


@pytest.mark.parametrize("tp,dp,names", [
    (1, 1, ["prefill.events.jsonl"]),
    (2, 1, ["prefill.rank0.events.jsonl", "prefill.rank1.events.jsonl"]),
    (1, 2, ["prefill.dp0.events.jsonl", "prefill.dp1.events.jsonl"]),
    (2, 2, ["prefill.dp0.rank0.events.jsonl", "prefill.dp0.rank1.events.jsonl", "prefill.dp1.rank0.events.jsonl",
            "prefill.dp1.rank1.events.jsonl"]),
])
def test_each_rank_of_each_dp_engine_core_writes_a_file_the_job_finds(tp, dp, names, tmp_path):
    """The connector's names (``for_dp_rank`` then ``rank_path``, as each engine
    core's workers resolve them) are the job's, one file per rank."""
    template = str(tmp_path / log_name("prefill", "events.jsonl", tp, dp))
    written = [for_dp_rank(settings_from({"kvplane_insecure": True, "kvplane_event_log": template}), k)
               .rank_path(template.replace("{dp}", str(k)), r) for k in range(dp) for r in range(tp)]
    assert written == [str(f) for f in rank_files(tmp_path, "prefill", "events.jsonl", tp, dp)]
    assert [f.name for f in rank_files(tmp_path, "prefill", "events.jsonl", tp, dp)] == names
    assert len(set(rank_stems("prefill", tp, dp))) == tp * dp


def test_a_dp_engine_core_without_a_dp_field_in_its_file_names_is_refused():
    """DP rank 1 with DP rank 0's file name would write over it: refused at
    the connector's construction (its engine fails to start), naming the key."""
    settings = settings_from({"kvplane_insecure": True, "kvplane_event_log": "/x/decode.events.jsonl",
                              "kvplane_status_file": "/x/decode.dp{dp}.status.json"})
    assert for_dp_rank(settings, 0).event_log == "/x/decode.events.jsonl"  # DP rank 0 (or no DP): as named
    assert for_dp_rank(settings, 0).status_file == "/x/decode.dp0.status.json"
    with pytest.raises(ConfigError, match="kvplane_event_log.*no \\{dp\\} field.*data-parallel rank 1"):
        for_dp_rank(settings, 1)
    both = settings_from({"kvplane_insecure": True, "kvplane_event_log": "/x/d.dp{dp}.rank{rank}.jsonl"})
    assert for_dp_rank(both, 1).rank_path(for_dp_rank(both, 1).event_log, 0) == "/x/d.dp1.rank0.jsonl"
    assert for_dp_rank(settings_from({"kvplane_insecure": True}), 3).event_log is None


def test_the_job_gives_each_dp_engine_core_a_core_and_its_side_channel_ports(tmp_path):
    """--decode-dp 2: D's engine is one server of two engine cores, each one
    OpenMP thread, no rank bound to a core (more ranks than cores: a bound rank
    starved beside a spinning one), its side channels base + k (TP 1) free."""
    pytest.importorskip("tokenizers", reason="the job writes its model's tokenizer (the vllm extra)")
    opts = _opts("--decode-dp", "2", "--out", str(tmp_path / "run"))
    specs = VllmRun(opts, say=lambda line: None).prepare()
    d, p = specs["D"], specs["P"]
    assert (d.dp, p.dp) == (2, 1)
    assert d.cpus == p.cpus == UNBOUND
    assert d.env()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and d.env()["OMP_NUM_THREADS"] == "1"
    assert d.extra_config["kvplane_event_log"].endswith("decode.dp{dp}.events.jsonl")
    assert d.extra_config["kvplane_status_file"].endswith("decode.dp{dp}.status.json")
    assert p.extra_config["kvplane_event_log"].endswith("/prefill.events.jsonl")
    ports = {p.side_channel_port, d.side_channel_port, d.side_channel_port + 1, p.http_port, d.http_port}
    assert len(ports) == 5  # D's second engine core's side channel is nobody else's port
