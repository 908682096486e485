"""Compatibility re-export, to be removed in the next release: ``kvcm.routing`` moved to
:mod:`kvcm.tools.routing` (the routing replay)."""

from kvcm.tools import routing as _moved
from kvcm.tools.routing import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
