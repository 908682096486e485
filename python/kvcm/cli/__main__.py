"""``python -m kvcm.cli``: the same command line as ``python -m kvcm`` (kept from when the
command line was the module ``kvcm/cli.py``)."""

from kvcm.cli import main

raise SystemExit(main())
