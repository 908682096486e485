"""kvcm inside other engines.  Nothing of kvcm's core imports this package (an import-linter
contract in pyproject.toml): an integration depends on kvcm, never the other way round."""
