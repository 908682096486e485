"""Which test modules of tests/ run in the cpp leg (issue 36 item 8).

The python and cpp legs (ci/matrix.sh) run tests/ on one backend each.  A test module whose
outcome cannot depend on that backend runs once: it is marked ``backend_independent`` here
and the cpp leg deselects the mark (``-m "not backend_independent"``); the python leg runs
everything.  A module is independent only if none of its tests builds a manager, block keys
or anything else from the leg's backend -- in process or in a child process -- (a manager
built with an explicit ``backend=`` is the same in both legs).  Single tests of a dependent
module can be independent (``INDEPENDENT_TESTS``).  Every test module under
tests/ is in exactly one of the two tables (tests/house/test_backend_legs.py holds it), so a
new module is classified on purpose; in the python leg a marked test that requests the
``backend`` fixture is refused at collection and one that lets kvcm pick the default
backend fails (tests/conftest.py ``_no_default_backend``)."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent

BACKEND_INDEPENDENT: dict[str, str] = {
    "core/test_copy_runs.py": "the copy-run grouping rule on plain lists",
    "cpp/test_cpp_backend.py": "each manager built with an explicit backend",
    "cpp/test_sha256.py": "the extension's SHA-256 against hashlib",
    "cpp/test_stub.py": "the .pyi stub against the build",
    "cpp/test_token_parse.py": "the extension's token parser, explicit backends",
    "dataplane/test_dataplane_parts.py": "the data plane's source structure (ast)",
    "dataplane/test_shared_store.py": "the shared tier's object format and stores, no manager",
    "engines/test_vllm_bench.py": "the vLLM bench's driver and report around a fake engine",
    "engines/test_vllm_identity.py": "the connector's model fingerprint, no manager",
    "house/test_backend_legs.py": "this table",
    "house/test_children.py": "a child's import path, no manager",
    "house/test_gaps_plugin.py": "the gap plugin in a sandbox with its own backend parametrization",
    "house/test_import_contracts.py": "the import graph",
    "house/test_mirror.py": "the C++ <-> Python pointers (source text)",
    "house/test_references.py": "paths named by the docs and CI",
    "house/test_seam.py": "the request/pool seam (source text)",
    "house/test_spec_citations.py": "SPEC and DECISIONS citations (source text)",
    "tools/test_cli_commands.py": "the command dispatcher, no manager",
}
BACKEND_DEPENDENT: frozenset[str] = frozenset({
    "core/test_backend_selection.py", "core/test_block_keys.py", "core/test_bounded_memory.py",
    "core/test_threads.py",
    "dataplane/test_dataplane.py", "dataplane/test_dataplane_faults.py", "dataplane/test_mooncake_setup.py",
    "dataplane/test_quota_plane.py", "dataplane/test_shared_plane.py",
    "engines/test_engine_beam.py", "engines/test_engine_exactness.py", "engines/test_engine_faults.py",
    "engines/test_engine_loop.py", "engines/test_offload_seam.py", "engines/test_transformers_cb.py",
    "engines/test_vllm_async.py",
    "engines/test_vllm_bench_engines.py", "engines/test_vllm_connector.py", "engines/test_vllm_disagg.py",
    "engines/test_vllm_handover.py", "engines/test_vllm_hybrid.py", "engines/test_vllm_hybrid_protocol.py",
    "engines/test_vllm_partial.py", "engines/test_vllm_partial_engine.py", "engines/test_vllm_settings.py",
    "engines/test_vllm_startup.py", "engines/test_vllm_step_costs.py", "engines/test_vllm_transfer_gpu.py",
    "engines/test_vllm_walkthrough.py",
    "fleet/test_events_faults.py", "fleet/test_events_zmq.py", "fleet/test_fleet.py", "fleet/test_proxy.py",
    "fleet/test_router_exact.py", "fleet/test_router_faults.py", "fleet/test_routing.py",
    "fleet/test_shared_engine.py", "fleet/test_soak.py", "fleet/test_wire.py",
    "house/test_docstrings.py", "house/test_readme_examples.py",
    "tools/test_bench.py", "tools/test_cli.py", "tools/test_metrics.py", "tools/test_oplog_bad_logs.py",
    "tools/test_oplog_lockstep_cost.py", "tools/test_oplog_ops.py", "tools/test_oplog_record.py",
    "tools/test_oplog_replay.py", "tools/test_replay.py",
})

# Tests of a BACKEND_DEPENDENT module that are independent themselves ("module::function"; the
# same guards hold them): tools/test_cli.py's answers to bad input, in process (checked before
# any manager) or in a child whose KVCM_BACKEND the test sets (run_py), and its runs that
# name each backend themselves; its runs through run_cli inherit the leg's backend and stay.
# fleet/test_proxy.py: the proxy's HTTP legs and command line (no manager); its prefix-aware
# choice reads the events of managers of the leg's backend and stays.
INDEPENDENT_TESTS: frozenset[str] = frozenset({
    "fleet/test_proxy.py::test_two_legs_prefill_with_one_token_then_decode_with_its_params",
    "fleet/test_proxy.py::test_streaming_is_passed_through_as_it_comes",
    "fleet/test_proxy.py::test_a_decode_instance_down_is_retried_on_another",
    "fleet/test_proxy.py::test_a_decode_instance_answering_5xx_is_retried_on_another",
    "fleet/test_proxy.py::test_every_backend_of_a_role_down_is_a_clear_503",
    "fleet/test_proxy.py::test_health_and_models",
    "fleet/test_proxy.py::test_a_backend_past_the_request_timeout_is_a_504",
    "fleet/test_proxy.py::test_decode_instance_chosen_by_requests_in_flight",
    "fleet/test_proxy.py::test_queue_bound_answers_503_when_full",
    "fleet/test_proxy.py::test_bad_request_bodies_are_refused_and_change_nothing",
    "fleet/test_proxy.py::test_command_line_errors_are_one_line_exit_2",
    "tools/test_cli.py::test_replay_input_length_1e400_is_a_bad_trace",
    "tools/test_cli.py::test_replay_true_as_a_length_is_a_bad_trace",
    "tools/test_cli.py::test_replay_fractional_length_is_a_bad_trace",
    "tools/test_cli.py::test_replay_hash_ids_as_a_string_is_a_bad_trace",
    "tools/test_cli.py::test_replay_record_that_is_not_an_object_is_a_bad_trace",
    "tools/test_cli.py::test_replay_truncated_gz_is_a_bad_trace",
    "tools/test_cli.py::test_replay_empty_trace_is_an_error_not_inf_requests_per_s",
    "tools/test_cli.py::test_replay_gpu_frac_inf_is_a_usage_error",
    "tools/test_cli.py::test_replay_gpu_blocks_10_to_18_is_capped_not_a_crash",
    "tools/test_cli.py::test_demo_unknown_device_is_a_usage_error",
    "tools/test_cli.py::test_exit_codes_are_documented",
    "tools/test_cli.py::test_unknown_kvcm_backend_is_one_line_exit_2_not_a_traceback",
    "tools/test_cli.py::test_unknown_kvcm_backend_still_fails_a_plain_import",
    "tools/test_cli.py::test_backend_rust_is_a_usage_error_on_every_command",
    "tools/test_cli.py::test_bench_backend_measures_only_that_backend",
    "tools/test_cli.py::test_route_bad_trace_is_one_line",
    "tools/test_cli.py::test_route_limit_0_is_refused_not_a_table_of_zero_rows",
    "tools/test_cli.py::test_route_gpu_blocks_negative_names_the_option_not_a_byte_quota",
    "tools/test_cli.py::test_route_unwritable_plot_is_refused_before_the_run",
    "tools/test_cli.py::test_events_bad_options_are_usage_errors",
    "tools/test_cli.py::test_events_connect_without_a_publisher_says_so_and_stops",
    "tools/test_cli.py::test_events_replay_endpoint_that_does_not_answer_is_one_line",
    "tools/test_cli.py::test_engine_bad_options_are_usage_errors",
    "tools/test_cli.py::test_engine_bad_input_after_parsing_is_one_line",
    "tools/test_cli.py::test_missing_extra_names_the_extra_to_install",
    "tools/test_cli.py::test_missing_torch_names_the_pinned_install",
    "tools/test_cli.py::test_all_extra_holds_every_other_extra",
    "tools/test_cli.py::test_kvcm_oplog_in_a_missing_directory_is_refused_not_created",
    "tools/test_cli.py::test_kvcm_oplog_in_proc_is_one_line_not_an_error_table",
})
