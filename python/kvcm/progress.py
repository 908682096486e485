"""Compatibility re-export, to be removed in the next release: ``kvcm.progress`` moved to
:mod:`kvcm.tools.progress` (the progress line)."""

from kvcm.tools import progress as _moved
from kvcm.tools.progress import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
