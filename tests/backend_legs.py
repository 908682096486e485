"""Which test modules of tests/ run in the cpp leg (issue 36 item 8).

The python and cpp legs (ci/matrix.sh) run tests/ on one backend each.  A test module whose
outcome cannot depend on that backend runs once: it is marked ``backend_independent`` here
and the cpp leg deselects the mark (``-m "not backend_independent"``); the python leg runs
everything.  A module is independent only if none of its tests builds a manager, block keys
or anything else from the leg's backend -- in process or in a child process -- (a manager
built with an explicit ``backend=`` is the same in both legs).  Every test module under
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
    "engines/test_engine_loop.py", "engines/test_transformers_cb.py", "engines/test_vllm_async.py",
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
