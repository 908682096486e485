"""``python -m kvcm``: see :mod:`kvcm.cli`."""

import os
import sys

from kvcm.cli import main

try:
    code = main()
    sys.stdout.flush()
except BrokenPipeError:  # `python -m kvcm info | head`: the reader left; not an error of ours
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 0
raise SystemExit(code)
