"""Compatibility re-export, to be removed in the next release: ``kvcm.cli_common`` moved to
:mod:`kvcm.cli.common` (the shared command-line helpers)."""

from kvcm.cli import common as _moved
from kvcm.cli.common import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
