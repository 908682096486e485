"""Compatibility re-export, to be removed in the next release: ``kvcm.events_cli`` moved to
:mod:`kvcm.cli.events` (``python -m kvcm events``)."""

from kvcm.cli import events as _moved
from kvcm.cli.events import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})
