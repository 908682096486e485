"""Compatibility re-export, to be removed in the next release: ``kvcm.bench_floor`` moved to
:mod:`kvcm.tools.bench_floor` (the benchmark floor)."""

from kvcm.tools import bench_floor as _moved
from kvcm.tools.bench_floor import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
