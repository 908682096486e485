"""SPEC sec. 10: concurrent calls on one manager never corrupt its state."""

from __future__ import annotations

import random
import threading

import kvcm
from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer, Status, Tier


def test_threads_hammering_one_manager_keep_invariants(backend: str) -> None:
    B = 4
    config = KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[AttentionLayer(0, 1), AttentionLayer(1, 1, window=8, sink_tokens=2), SsmLayer(2, 8)],
        tiers=[Tier("gpu", 40 * 16), Tier("host", 40 * 16)],
    )
    mgr = kvcm.KVCacheManager(config, backend=backend)
    prefixes = [[p] * 9 for p in range(3)]
    errors: list[BaseException] = []
    done = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(6))]
                kv = mgr.create_kv_cache(prompt)
                if kv.resume() and kv.resize(len(prompt) + 2):
                    kv.commit(prompt[kv.num_committed_tokens:])
                    if mgr.resize_batch([kv], [kv.capacity + 1]) == [True]:  # a batch holds the lock throughout
                        mgr.commit_batch([kv], [rng.randrange(5)])
                    kv.page_indices(0)
                    if rng.random() < 0.3:
                        kv.suspend()
                kv.close()
                assert kv.status == Status.CLOSED
                mgr.drain_copy_ops()
                done[0] += 1
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert done[0] == 600
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats["requests"] == 600
    assert stats["reused_tokens"] > 0


def test_properties_read_while_another_thread_closes_the_cache(backend: str) -> None:
    """Issue 8 item 14: a closed cache answers its properties, also when the close runs on
    another thread while they are read (cpp raised ClosedError in that window)."""
    config = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 1)], tiers=[Tier("gpu", 4 * 64)])
    mgr = kvcm.KVCacheManager(config, backend=backend)
    errors: list[BaseException] = []
    for i in range(150):
        prompt = [1000 + i, *range(9)]  # no reuse: every cache starts empty
        kv = mgr.create_kv_cache(prompt)
        assert kv.resume() and kv.resize(12)
        kv.commit(prompt)
        go = threading.Event()

        def close(kv=kv, go=go) -> None:
            go.wait()
            kv.close()

        t = threading.Thread(target=close)
        t.start()
        go.set()
        try:
            while True:
                seen = (kv.status, kv.capacity, kv.history_length, kv.num_committed_tokens,
                        kv.num_reused_tokens, kv.committed_tokens)
                assert seen[1:] == (12, 10, 10, 0, prompt)
                if seen[0] is Status.CLOSED:
                    break
        except Exception as e:  # noqa: BLE001 - collected, asserted below
            errors.append(e)
        t.join()
        assert kv.status is Status.CLOSED and kv.committed_tokens == prompt
    assert not errors, f"{len(errors)} reads failed, e.g. {errors[0]!r}"
    mgr.check_invariants()
