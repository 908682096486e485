"""Compatibility re-export, to be removed in the next release: ``kvcm.router_link`` moved to
:mod:`kvcm.fleet.loopback` (the in-process loopback link)."""

from kvcm.fleet import loopback as _moved
from kvcm.fleet.loopback import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
