"""Compatibility re-export, to be removed in the next release: ``kvcm.soak`` moved to
:mod:`kvcm.tools.soak` (the fleet soak)."""

from kvcm.tools import soak as _moved
from kvcm.tools.soak import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})

if __name__ == "__main__":  # ``python -m kvcm.soak`` keeps working
    raise SystemExit(main())
