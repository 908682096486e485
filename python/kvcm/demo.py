"""Compatibility re-export, to be removed in the next release: ``kvcm.demo`` moved to
:mod:`kvcm.tools.demo` (the demo)."""

from kvcm.tools import demo as _moved
from kvcm.tools.demo import *  # the public names, for readers and type checkers

# every name of the moved module, private ones and __all__ included: old imports keep working
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__") or k == "__all__"})

if __name__ == "__main__":  # ``python -m kvcm.demo`` keeps working
    raise SystemExit(main())
