"""Issue 21 item 3: the outer house moved into role-named subpackages (kvcm.fleet,
kvcm.dataplane, kvcm.tools, kvcm.cli, kvcm.oplog.ops).  Every former module path keeps
importing for one release and exposes the very objects of its new home (compatibility
re-exports, to be removed in the next release)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# former module -> its new home
MOVED = {
    "kvcm.wire": "kvcm.fleet.wire",
    "kvcm.wire_state": "kvcm.fleet.wire_state",
    "kvcm.events": "kvcm.fleet.publisher",
    "kvcm.router": "kvcm.fleet.router_index",
    "kvcm.router_client": "kvcm.fleet.subscriber",
    "kvcm.router_link": "kvcm.fleet.loopback",
    "kvcm.routing": "kvcm.tools.routing",
    "kvcm.shared_store": "kvcm.dataplane.store",
    "kvcm.mooncake_store": "kvcm.dataplane.mooncake_store",
    "kvcm.replay": "kvcm.tools.replay",
    "kvcm.bench": "kvcm.tools.bench",
    "kvcm.bench_floor": "kvcm.tools.bench_floor",
    "kvcm.trace": "kvcm.tools.trace",
    "kvcm.demo": "kvcm.tools.demo",
    "kvcm.progress": "kvcm.tools.progress",
    "kvcm.soak": "kvcm.tools.soak",
    "kvcm.cli_common": "kvcm.cli.common",
    "kvcm.events_cli": "kvcm.cli.events",
    "kvcm.route_cli": "kvcm.cli.route",
    "kvcm.ops": "kvcm.oplog.ops",
}

# what the former one-module kvcm.dataplane had at its top level (its __all__ and the names
# tests and integrations used)
DATAPLANE_NAMES = [
    "COPY_REASONS", "DataPlane", "DiskPool", "open_store", "remove_stale_pool_files", "POOL_PREFIX", "TRAILER",
    "MAGIC", "STAGING_MAX_BYTES", "HEADER", "BadObjectError", "FileStore", "ObjectCodec", "SharedStore", "Staging",
    "parse_timeout", "store_secret",
]
# the public names of the former module kvcm/fleet.py (the fleet replay)
FLEET_REPLAY_NAMES = [
    "NUM_LAYERS", "FleetResult", "fleet_config", "fleet_table", "format_header", "main_fleet", "plot",
    "raw_throughput", "resolve_shared", "run_fleet",
]
CLI_NAMES = ["main", "build_parser", "cmd_info", "cmd_replay", "cmd_bench", "cmd_fleet", "cmd_oplog_replay",
             "run_replays", "DEFAULT_REPLAY_LIMIT", "DEFAULT_BENCH_LIMIT", "REPLAY_EXIT_CODES"]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_former_module_path_reexports_every_name_of_its_new_home(old):
    new = importlib.import_module(MOVED[old])
    shim = importlib.import_module(old)
    assert shim is not new
    names = [k for k in vars(new) if not k.startswith("__")]
    assert names, MOVED[old]
    missing = [k for k in names if not hasattr(shim, k)]
    assert not missing, f"{old} lacks {missing}"
    differ = [k for k in names if getattr(shim, k) is not getattr(new, k)]
    assert not differ, f"{old}: not the same objects as {MOVED[old]}: {differ}"
    assert getattr(shim, "__all__", None) == getattr(new, "__all__", None)
    assert "to be removed in the next release" in (shim.__doc__ or "")


def test_star_import_of_a_former_path_gives_the_new_homes_public_names():
    ns: dict = {}
    exec("from kvcm.events import *", ns)  # noqa: S102 - the import statement under test
    from kvcm.fleet import publisher

    assert set(ns) - {"__builtins__"} == set(publisher.__all__)


def test_dataplane_package_keeps_the_module_names():
    dp = importlib.import_module("kvcm.dataplane")
    assert isinstance(dp, types.ModuleType) and hasattr(dp, "__path__")  # a package now
    for name in DATAPLANE_NAMES:
        assert hasattr(dp, name), name
    assert dp.__all__ == ["COPY_REASONS", "DataPlane", "DiskPool", "open_store", "remove_stale_pool_files"]
    from kvcm.dataplane.disk_pool import DiskPool
    from kvcm.dataplane.plane import DataPlane
    from kvcm.dataplane.store_factory import open_store

    assert (dp.DataPlane, dp.DiskPool, dp.open_store) == (DataPlane, DiskPool, open_store)


def test_cli_package_keeps_the_module_names():
    cli = importlib.import_module("kvcm.cli")
    for name in CLI_NAMES:
        assert hasattr(cli, name), name
    assert callable(cli.main)


def test_fleet_package_serves_the_fleet_replays_names_lazily():
    """kvcm.fleet (formerly the fleet replay module) serves the replay's names through a lazy
    __getattr__; importing the fleet layer itself imports no tool."""
    code = (
        "import sys, kvcm.fleet, kvcm.fleet.wire, kvcm.fleet.publisher, kvcm.fleet.router_index,"
        " kvcm.fleet.subscriber, kvcm.fleet.loopback\n"
        "assert not [m for m in sys.modules if m.startswith('kvcm.tools')], sorted(sys.modules)\n"
        "try:\n    kvcm.fleet.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')\n"
        "assert not [m for m in sys.modules if m.startswith('kvcm.tools')]\n"
        "from kvcm.fleet import run_fleet\n"
        "import kvcm.tools.fleet_replay as fr\n"
        f"assert all(getattr(kvcm.fleet, n) is getattr(fr, n) for n in {FLEET_REPLAY_NAMES!r})\n"
        "assert run_fleet is fr.run_fleet\n"
        f"assert set({FLEET_REPLAY_NAMES!r}) <= set(dir(kvcm.fleet))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("module", ["kvcm.soak", "kvcm.tools.soak", "kvcm.cli", "kvcm.tools.engine_instance"])
def test_python_dash_m_of_former_and_new_paths_still_runs(module):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    args = ["info"] if module == "kvcm.cli" else ["--help"]
    r = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip()
