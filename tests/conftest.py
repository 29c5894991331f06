import os

import pytest
from hypothesis import settings

# No property test depends on the wall clock: hypothesis's 200 ms deadline per
# example failed test_transport_wire on a loaded 2-core machine (776 ms for an
# example that takes 0.15 ms alone).  A test's own @settings keeps its others.
settings.register_profile("kvplane", deadline=None)
settings.load_profile("kvplane")

# Must happen before anything imports NIXL/UCX: keep UCX on loopback and NIXL quiet.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

# The kind of each test file (the markers are registered in pyproject.toml):
#   core  in-process and fast (seconds): the state machines, event log,
#         replay, monitors, the loopback transport and the driver over it;
#   nixl  needs a real NIXL agent (UCX over loopback on a CPU machine);
#   e2e   runs the main job, the CLI or the benchmarks as processes;
#   vllm  needs vLLM installed (scripts/install-vllm); skipped, with the reason, without it;
#   None  in-process but slower, so only in the full suite: the explorer's
#         exhaustive runs, the hypothesis fuzzers, the ZMQ side channel.
# A test that differs from its file says so with its own marker
# (``@pytest.mark.nixl``), which wins.  Every test file must be listed, so
# that ``-m core`` never silently misses a new one.
FILE_KINDS: dict[str, str | None] = {
    "test_bench_connector.py": "core",
    "test_vllm_engine_stop.py": "core",
    "test_vllm_amx.py": "core",
    "test_bench_smoke.py": "e2e",
    "test_bench_targets.py": "core",
    "test_block_sizes.py": "nixl",
    "test_block_sizes_vllm.py": "vllm",
    "test_cli.py": None,
    "test_cli_errors.py": "core",
    "test_data_parallel.py": "core",
    "test_kv_check.py": "core",
    "test_composition.py": "core",
    "test_config_kv_transfer.py": "core",
    "test_connector_facade.py": "core",
    "test_connector_loopback.py": None,
    "test_connector_peer_faults.py": "core",
    "test_connector_split.py": "core",
    "test_core_nonfinite.py": "core",
    "test_core_plane.py": "core",
    "test_core_scenarios.py": "core",
    "test_core_transitions.py": "core",
    "test_core_validation.py": "core",
    "test_datapath_figures.py": "core",
    "test_diagrams.py": "core",
    "test_driver_loop.py": "core",
    "test_e2e_mainjob.py": "e2e",
    "test_engine_request.py": "core",
    "test_e2e_replay.py": "e2e",
    "test_e2e_summary_counts.py": "e2e",
    "test_eventlog.py": "core",
    "test_eventlog_batches.py": "core",
    "test_explorer.py": None,
    "test_explorer_engine.py": "core",
    "test_explorer_ranks.py": None,
    "test_explorer_restart.py": None,
    "test_fuzz_decoders.py": None,
    "test_fuzz_handshake.py": None,
    "test_heartbeat_phase.py": "core",
    "test_heartbeat_spread_explorer.py": None,
    "test_hostile_params.py": "nixl",
    "test_layering.py": "core",
    "test_netns.py": "e2e",
    "test_log_stream.py": "core",
    "test_monitors.py": "core",
    "test_nixl_restart.py": "nixl",
    "test_packaging.py": "core",
    "test_kv_groups.py": "core",
    "test_mla.py": "core",
    "test_mla_tp.py": "core",
    "test_param_auth.py": "core",
    "test_incarnation.py": "core",
    "test_params.py": "core",
    "test_plane_reference.py": "core",
    "test_plane_cpu.py": "core",
    "test_plane_observers.py": "core",
    "test_plane_properties.py": "core",
    "test_plane_timers.py": "core",
    "test_proxy.py": "core",
    "test_read_gate_property.py": "core",
    "test_recv_failure.py": "core",
    "test_reference_interpreter.py": "core",
    "test_rank_factory.py": "core",
    "test_readme.py": "core",
    "test_replay.py": "core",
    "test_replay_old_logs.py": "core",
    "test_security_nixl.py": "nixl",
    "test_split_multiprocess.py": "nixl",
    "test_sequence.py": "core",
    "test_ticker.py": "core",
    "test_turn2_params.py": "core",
    "test_transport_coalesce.py": "nixl",
    "test_transport_endpoint.py": "core",
    "test_transport_gpu_check.py": "nixl",
    "test_transport_handshake.py": None,
    "test_transport_loopback.py": "core",
    "test_transport_multiprocess.py": "nixl",
    "test_transport_nixl.py": "nixl",
    "test_transport_parts.py": "nixl",
    "test_transport_prepped.py": "nixl",
    "test_transport_wire.py": "core",
    "test_tp_mapping.py": "core",
    "test_pipeline_parallel.py": "core",
    "test_vllm_pp.py": "vllm",
    "test_vllm_adapter.py": "core",
    "test_vllm_worker_side.py": "nixl",
    "test_vllm_push_worker.py": "nixl",
    "test_vllm_adversarial.py": "vllm",
    "test_vllm_engine.py": "vllm",
    "test_vllm_scheduler.py": "vllm",
    "test_vllm_parity.py": "vllm",
    "test_vllm_push.py": "vllm",
    "test_vllm_netns.py": "vllm",
}
KINDS = ("core", "nixl", "e2e", "vllm")


def pytest_collection_modifyitems(config, items):
    unlisted = sorted({item.path.name for item in items if item.path.name not in FILE_KINDS})
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py: give {', '.join(unlisted)} a kind in FILE_KINDS")
    for item in items:
        kind = FILE_KINDS[item.path.name]
        if kind is not None and not any(item.get_closest_marker(k) for k in KINDS):
            item.add_marker(kind)


# CI sets KVPLANE_NO_SKIPS=1: there every dependency is installed, so a
# skipped test means a check silently did not run.
_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("KVPLANE_NO_SKIPS") == "1" and _skipped:
        print(f"\nKVPLANE_NO_SKIPS=1 but {len(_skipped)} test(s) skipped: " + ", ".join(_skipped))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
