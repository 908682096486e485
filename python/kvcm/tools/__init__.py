"""Tools that drive kvcm from the outside: the trace replay and its trace loader
(:mod:`~kvcm.tools.replay`, :mod:`~kvcm.tools.trace`), the fleet replay over a shared tier
(:mod:`~kvcm.tools.fleet_replay`), the routing replay (:mod:`~kvcm.tools.routing`), the
fleet soak (:mod:`~kvcm.tools.soak`, ``python -m kvcm.tools.soak``) and the progress line
(:mod:`~kvcm.tools.progress`).

Layering (pyproject.toml, import-linter): the tools sit above the fleet, the engine and the
data plane, below the benchmarks (:mod:`kvcm.bench`) and the command line (:mod:`kvcm.cli`).
Importing this package imports none of its modules.
"""
