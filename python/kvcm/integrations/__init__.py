"""kvcm inside other engines (each an optional extra: ``kvcm[vllm]``, ``kvcm[transformers]``).
Nothing of kvcm's core imports this package (import-linter contracts in pyproject.toml): an
integration depends on kvcm, never the other way round."""
