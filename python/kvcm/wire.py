"""Compatibility re-export, to be removed in the next release: ``kvcm.wire`` moved to
:mod:`kvcm.fleet.wire` (the vLLM KV-event wire format)."""

from kvcm.fleet import wire as _moved
from kvcm.fleet.wire import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
