"""Compatibility re-export, to be removed in the next release: ``kvcm.shared_store`` moved to
:mod:`kvcm.dataplane.store` (the shared tier's store interface and file store)."""

from kvcm.dataplane import store as _moved
from kvcm.dataplane.store import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
