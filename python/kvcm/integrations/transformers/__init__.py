"""kvcm as the block manager of Hugging Face transformers' continuous batching (issue 23).

``with KvcmContinuousBatching(model, ...) as kc:`` makes the paged cache that ``model``'s
continuous batching builds inside the block (``model.generate_batch``,
``model.init_continuous_batching``) a :class:`KvcmPagedAttentionCache`: its paged KV blocks
are allocated, shared, evicted, offloaded and restored by a kvcm manager (backend by
``KVCM_BACKEND``), its page indices are kvcm's, kvcm's data plane moves the bytes, and a copy
that fails costs a recomputation.  Other models and the rest of the process are untouched.
See DECISIONS.md "transformers continuous batching (issue 23)".
"""

from kvcm.integrations.transformers.cache import (
    PINNED_TRANSFORMERS,
    PINS,
    KvcmContinuousBatching,
    KvcmPagedAttentionCache,
    ModelCacheHook,
    Pin,
    build_batch_processor,
    check_pinned_internals,
    interface_pins,
)

__all__ = ["PINNED_TRANSFORMERS", "PINS", "KvcmContinuousBatching", "KvcmPagedAttentionCache", "ModelCacheHook", "Pin",
           "build_batch_processor", "check_pinned_internals", "interface_pins"]
