"""kvcm as the block manager of Hugging Face transformers' continuous batching (issue 23).

``with KvcmContinuousBatching(...) as kc:`` makes every ``PagedAttentionCache`` that
transformers builds inside the block (``model.generate_batch``, ``model.init_continuous_batching``)
a :class:`KvcmPagedAttentionCache`: its paged KV blocks are allocated, shared, evicted, offloaded
and restored by a kvcm manager (backend by ``KVCM_BACKEND``), its page indices are kvcm's, and
kvcm's data plane moves the bytes.  See DECISIONS.md "transformers continuous batching (issue 23)".
"""

from kvcm.integrations.transformers.cache import (
    PINNED_TRANSFORMERS,
    KvcmContinuousBatching,
    KvcmPagedAttentionCache,
    check_pinned_internals,
)

__all__ = ["PINNED_TRANSFORMERS", "KvcmContinuousBatching", "KvcmPagedAttentionCache", "check_pinned_internals"]
