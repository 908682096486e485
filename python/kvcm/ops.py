"""Compatibility re-export, to be removed in the next release: ``kvcm.ops`` moved to
:mod:`kvcm.oplog.ops` (the op vocabulary)."""

from kvcm.oplog import ops as _moved
from kvcm.oplog.ops import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
