"""Fixtures of tests/ (the backend fixtures live in the root conftest)."""

from mooncake_env import fresh_mooncake, mooncake

__all__ = ["fresh_mooncake", "mooncake"]
