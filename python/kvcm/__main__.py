"""``python -m kvcm``: see :mod:`kvcm.cli`."""

from kvcm.cli import main

raise SystemExit(main())
