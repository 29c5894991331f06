"""Every bad input to the ``kvplane`` CLI: one line on stderr, exit 2, no
traceback (and, where a command has ``--json``, the refusal as one object
on stdout).  Each case is a finding of issue 35 (a traceback, an exit 0
without a word, an error as a Python repr, or on stdout)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvplane.app.cli import main
from sequence_support import recorded_pull

UNWRITABLE = "/proc/kvplane-nowhere/x"  # /proc refuses new entries, even to root


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, str]:
    """A recorded P and D log pair (loopback), an empty file, and D's log with a torn last line."""
    d = tmp_path_factory.mktemp("logs")
    paths = {}
    for side, lines in recorded_pull().items():
        path = d / f"{side}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths[side] = str(path)
    (d / "empty.jsonl").write_text("")
    paths["empty"] = str(d / "empty.jsonl")
    whole = Path(paths["D"]).read_text()
    (d / "torn.jsonl").write_text(whole + whole.splitlines()[-1][:25])  # a writer killed mid-line
    paths["torn"] = str(d / "torn.jsonl")
    # A torn line in the middle is still an error.
    lines = whole.splitlines()
    lines[3] = lines[3][:25]
    (d / "torn-middle.jsonl").write_text("\n".join(lines) + "\n")
    paths["torn_middle"] = str(d / "torn-middle.jsonl")
    return paths


def _refused(capsys, argv: list[str], words: str) -> str:
    """``argv`` exits 2 with one line on stderr holding ``words``; returns stdout."""
    code = main(argv)
    got = capsys.readouterr()
    assert code == 2, (argv, got.out, got.err)
    assert len(got.err.splitlines()) == 1, got.err
    assert words in got.err and "Traceback" not in got.err + got.out
    return got.out


def _main_exits(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's refusal
        return int(exc.code or 0)


@pytest.mark.parametrize("argv,words", [
    (["explore", "--depth", "-1"], "--depth: must be >= 1, got -1"),
    (["explore", "--faults", "-1"], "--faults: must be >= 0, got -1"),
    (["explore", "--aborts", "-2"], "--aborts: must be >= 0"),
    (["explore", "--max-states", "0"], "--max-states: must be >= 1, got 0"),
    (["explore", "--skew", "nan"], "--skew: must be a finite number"),
    (["explore", "--depth", "x"], "--depth: not an integer: 'x'"),
    (["sequence", "a.jsonl", "b.jsonl", "--max-events", "0"], "--max-events: must be >= 1"),
    (["sequence", "a.jsonl", "b.jsonl", "--from", "inf"], "--from: must be a finite number"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["run", "--engine", "vllm", "--prefill-block-size", "48"], "--prefill-block-size: must be a multiple of 32"),
    (["run", "--engine", "vllm", "--decode-block-size", "2048"], "--decode-block-size: must be a multiple of 32 in"),
])
def test_nonsense_options_are_refused_by_the_parser(argv, words, capsys):
    assert _main_exits(argv) == 2
    got = capsys.readouterr()
    assert got.out == "" and len(got.err.splitlines()) == 1 and words in got.err, got.err
    assert "Traceback" not in got.err


@pytest.mark.parametrize("argv,words", [
    (["explore", "--requests", "bogus"], "unknown profile(s) bogus (known: read"),
    (["explore", "--ranks", "2y2"], "--ranks takes PxD"),
])
def test_explore_names_a_bad_value_in_words_not_a_repr(argv, words, capsys):
    _refused(capsys, argv, words)
    assert main([*argv, "--json"]) == 2
    got = capsys.readouterr()
    obj = json.loads(got.out)
    assert obj["ok"] is False and words in obj["error"] and "KeyError" not in obj["error"]


def test_sequence_refuses_an_empty_log(logs, capsys):
    _refused(capsys, ["sequence", logs["empty"], logs["D"]], "has no event line")
    _refused(capsys, ["sequence", logs["P"], logs["empty"]], "has no event line")


def test_sequence_refuses_the_same_log_twice_and_an_empty_window(logs, capsys):
    _refused(capsys, ["sequence", logs["P"], logs["P"]], "the same file")
    _refused(capsys, ["sequence", logs["P"], logs["D"], "--from", "5", "--to", "1"], "--from 5 is after --to 1")
    _refused(capsys, ["sequence", logs["P"], logs["D"], "--from", "1000"], "no event between --from 1000")


def test_sequence_with_the_logs_swapped_draws_them_as_their_content_says(logs, capsys):
    assert main(["sequence", logs["P"], logs["D"]]) == 0
    right = capsys.readouterr().out
    assert main(["sequence", logs["D"], logs["P"]]) == 0
    got = capsys.readouterr()
    assert "a decode log" in got.err and "drawn with" in got.err
    # The same diagram, but for the header's file names.
    body = [x for x in right.splitlines() if not x.lstrip().startswith("%%")]
    assert [x for x in got.out.splitlines() if not x.lstrip().startswith("%%")] == body


def test_sequence_json_is_one_object_on_stdout(logs, capsys, tmp_path):
    assert main(["sequence", logs["P"], logs["D"], "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["command"] == "sequence" and obj["ok"] and obj["items"] > 0 and obj["mermaid"].startswith("sequenceDiagram")
    out = tmp_path / "seq.mmd"
    assert main(["sequence", logs["P"], logs["D"], "--json", "-o", str(out)]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["written"] == [str(out)] and obj["mermaid"] is None and out.read_text().startswith("sequenceDiagram")


@pytest.mark.parametrize("argv", [
    ["diagrams", "--out", UNWRITABLE],
    ["run", "--out", UNWRITABLE],
    ["explore", "--depth", "2", "--out", UNWRITABLE],
])
def test_an_unwritable_out_is_one_line(argv, capsys):
    _refused(capsys, argv, "kvplane-nowhere")


def test_sequence_to_an_unwritable_file_is_one_line(logs, capsys):
    _refused(capsys, ["sequence", logs["P"], logs["D"], "-o", UNWRITABLE + ".mmd"], "cannot write")


def test_diagrams_check_of_a_missing_folder_is_bad_input(capsys, tmp_path):
    _refused(capsys, ["diagrams", "--check", "--out", str(tmp_path / "none")], "no folder")


def test_run_refuses_bad_options_on_stderr_with_json_on_stdout(capsys):
    out = _refused(capsys, ["run", "--lease", "nan", "--json"], "--lease must be a finite number")
    assert json.loads(out) == {"command": "run", "schema": 1, "ok": False,
                               "error": "kvplane run: --lease must be a finite number, got nan"}
    assert _refused(capsys, ["run", "--requests", "0"], "--requests must be >= 1") == ""


@pytest.mark.parametrize("command", ["replay", "check-log"])
def test_a_torn_last_line_is_read_up_to_the_line_before_with_a_warning(command, logs, capsys):
    whole = main([command, "--json", logs["D"]])
    expected = json.loads(capsys.readouterr().out)
    assert main([command, "--json", logs["torn"]]) == whole
    got = capsys.readouterr()
    assert len(got.err.splitlines()) == 1 and "is torn" in got.err
    obj = json.loads(got.out)
    assert obj["lines"] == expected["lines"] and obj["ok"] == expected["ok"]


@pytest.mark.parametrize("command", ["replay", "check-log"])
def test_a_torn_line_in_the_middle_is_still_an_error(command, logs, capsys):
    _refused(capsys, [command, logs["torn_middle"]], "line 4: not JSON")


@pytest.mark.parametrize("command", ["replay", "check-log"])
def test_a_missing_log_is_one_line(command, capsys, tmp_path):
    _refused(capsys, [command, str(tmp_path / "none.jsonl")], "No such file or directory")


def test_nothing_was_written_where_it_could_not_be():
    assert not os.path.exists(os.path.dirname(UNWRITABLE))


def test_run_without_torch_names_the_extra_in_one_line(capsys, monkeypatch, tmp_path):
    """torch is the `run` extra: the core installs without it."""
    from kvplane.app.job import orchestrator

    monkeypatch.setattr(orchestrator, "torch_installed", lambda: False)
    _refused(capsys, ["run", "--out", str(tmp_path / "run")], "pip install -e '.[run]' --extra-index-url")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv,words", [
    (["run", "--engine", "vllm", "--prefill-block-size", "64", "--decode-block-size", "32"],
     "P's smaller blocks are read into D's larger ones only"),
    (["run", "--engine", "vllm", "--push", "--prefill-block-size", "32", "--decode-block-size", "64"],
     "without --push or --bidirectional"),
    (["run", "--engine", "vllm", "--bidirectional", "--prefill-block-size", "32", "--decode-block-size", "64"],
     "without --push or --bidirectional"),
    (["run", "--engine", "vllm", "--connector", "nixl", "--prefill-block-size", "64", "--decode-block-size", "96"],
     "--decode-block-size 96 must be a whole multiple of --prefill-block-size 64"),
    (["run", "--engine", "vllm", "--connector", "nixl", "--prefill-block-size", "64", "--decode-block-size", "32"],
     "must be a whole multiple"),
    (["run", "--engine", "vllm", "--connector", "nixl", "--decode-block-size", "256", "--prefill-tp", "2"],
     "unlike block sizes run with --model tiny, --prefill-tp 1"),
    (["run", "--decode-block-size", "64"], "--decode-block-size needs --engine vllm"),
])
def test_block_sizes_no_connector_moves_are_refused_in_one_line(argv, words, capsys):
    _refused(capsys, argv, words)


def test_each_engine_gets_its_block_size():
    from kvplane.app.vllm.engines import EngineSpec
    from kvplane.app.vllm.run import options_from_args
    from kvplane.app.cli import build_parser

    args = build_parser().parse_args(["run", "--engine", "vllm", "--connector", "nixl", "--prefill-block-size", "32",
                                      "--decode-block-size", "64"])
    opts = options_from_args(args)
    assert (opts.prefill_block_size, opts.decode_block_size) == (32, 64)
    cmd = EngineSpec(name="D", engine_id="d", http_port=1, side_channel_port=2, connector="nixl",
                     block_size=64).command("/m")
    assert cmd[cmd.index("--block-size") + 1] == "64"
    assert "--block-size" not in EngineSpec(name="P", engine_id="p", http_port=1, side_channel_port=2,
                                            connector="nixl").command("/m")


@pytest.mark.parametrize("argv", [
    ["run", "--engine", "vllm", "--model", "mtp", "--push"],
    ["run", "--engine", "vllm", "--model", "mtp", "--bidirectional"],
    ["run", "--engine", "vllm", "--model", "mtp", "--decode-tp", "2"],
])
def test_the_mtp_model_runs_pull_one_turn_at_tp_1(argv, capsys):
    _refused(capsys, argv, "--model mtp runs with --prefill-tp 1 and --decode-tp 1, without --push or --bidirectional")


def test_mtp_engines_get_the_model_s_speculative_config():
    """``--model mtp``: every engine (kvplane's and NixlConnector's alike)
    runs multi-module MTP, 2 speculative tokens; the other models none."""
    from kvplane.app.vllm.engines import EngineSpec
    from kvplane.app.vllm.model import speculative_config

    spec = speculative_config("mtp")
    assert spec == {"method": "mtp", "num_speculative_tokens": 2}
    assert all(speculative_config(m) is None for m in ("tiny", "hybrid", "mla"))
    cmd = EngineSpec(name="P", engine_id="p", http_port=1, side_channel_port=2, connector="nixl",
                     speculative=spec).command("/m")
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == spec
    assert "--speculative-config" not in EngineSpec(name="P", engine_id="p", http_port=1, side_channel_port=2,
                                                    connector="nixl").command("/m")
