"""Compatibility re-export, to be removed in the next release: ``kvcm.trace`` moved to
:mod:`kvcm.tools.trace` (the trace loader)."""

from kvcm.tools import trace as _moved
from kvcm.tools.trace import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
