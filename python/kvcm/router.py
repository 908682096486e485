"""Compatibility re-export, to be removed in the next release: ``kvcm.router`` moved to
:mod:`kvcm.fleet.router_index` (the router's index)."""

from kvcm.fleet import router_index as _moved
from kvcm.fleet.router_index import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
