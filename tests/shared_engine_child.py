"""One engine instance in its own process (``python tests/shared_engine_child.py ...``): the
arguments of ``python -m kvcm.tools.engine_instance`` plus ``--fault``, which injects a fault into this
process's data plane (tests/fleet/test_shared_engine.py):

* ``delete-after-lookup``: every object a lookup found is removed right after the lookup,
  before the request's load (evicted / deleted between the two);
* ``truncate-after-lookup``: likewise, but each found object is cut short;
* ``foreign-after-lookup``: likewise, but each found object is replaced by another one's bytes
  (a well-formed object of another key);
* ``kill-master-after-lookup:PID``: the Mooncake master (PID) is killed right after the
  first lookup that found something (the store goes down mid-run);
* ``fail-puts``: every other object this process writes fails (a failed write).

``--barrier DIR``: once imported, write ``DIR/ready-<pid>`` and wait for ``DIR/go`` before
running (the test starts processes at the same time).

Writes the outcome (``kvcm.tools.engine_instance.run_instance``) as JSON to ``--json``, with ``fault_hits``:
how often the fault fired, and ``run_span``: the wall-clock [start, end] of the run."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from kvcm.dataplane import DataPlane
from kvcm.dataplane.shared_io import SharedIO
from kvcm.dataplane.store import HEADER, Staging
from kvcm.tools import engine_instance

fired = {"n": 0}


def rewrite(plane: DataPlane, names: list[str], fault: str) -> None:
    """Replace each object through the store's own API: by its first 50 bytes (truncated),
    or by the next object's whole bytes (foreign: a valid object of another key)."""
    store = plane.shared
    size = HEADER.size + max(lc.slot_bytes for lc in plane.life_cycles)
    st = Staging(size * len(names))
    store.register(st)
    try:
        got = store.get([(n, i * size, size) for i, n in enumerate(names)], st)
        blobs = [bytes(st.view[i * size:i * size + g]) for i, g in enumerate(got) if isinstance(g, int)]
        assert len(blobs) == len(names)
        if fault == "foreign-after-lookup":
            blobs = blobs[1:] + blobs[:1]
        else:
            blobs = [b[:50] for b in blobs]
        store.remove(names)  # (a Mooncake put does not replace an existing object)
        for i, b in enumerate(blobs):
            st.view[i * size:i * size + len(b)] = b
        assert store.put([(n, i * size, len(b)) for i, (n, b) in enumerate(zip(names, blobs))], st) == [None] * len(names)
    finally:
        store.unregister(st)
        st.close()


def install(fault: str) -> None:
    lookup = DataPlane.shared_lookup

    def after_lookup(self, candidates):
        hits = lookup(self, candidates)
        if not hits:
            return hits
        names = [self.codec.name(k, lc) for k, lc in hits]
        if fault == "delete-after-lookup":
            self.shared.remove(names)
        elif fault in ("truncate-after-lookup", "foreign-after-lookup"):
            rewrite(self, names, fault)
        elif fault.startswith("kill-master-after-lookup:"):
            if fired["n"]:
                return hits
            os.kill(int(fault.split(":")[1]), signal.SIGKILL)
        fired["n"] += 1
        return hits

    if fault == "fail-puts":
        store_batch = SharedIO.store_batch

        def failing(self, ops):
            put = self.store.put

            def half(items, staging):  # the even items fail before anything is written
                done = iter(put([it for i, it in enumerate(items) if i % 2], staging))
                fired["n"] += (len(items) + 1) // 2
                return [OSError(5, "injected put failure") if i % 2 == 0 else next(done) for i in range(len(items))]

            self.store.put = half
            try:
                return store_batch(self, ops)
            finally:
                del self.store.put

        SharedIO.store_batch = failing
    else:
        DataPlane.shared_lookup = after_lookup


def main() -> int:
    p = engine_instance.instance_parser()
    p.add_argument("--fault", default=None)
    p.add_argument("--barrier", default=None)
    args = p.parse_args()
    if args.fault:
        install(args.fault)
    if args.barrier:
        with open(os.path.join(args.barrier, f"ready-{os.getpid()}"), "w"):
            pass
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(args.barrier, "go")):
            if time.monotonic() > deadline:
                raise TimeoutError("no go from the test")
            time.sleep(0.01)
    t0 = time.time()
    res = engine_instance.run_instance(args)
    res["run_span"] = [t0, time.time()]
    res["fault_hits"] = fired["n"]
    with open(args.json, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
