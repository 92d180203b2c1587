"""Configuration parsing shared by every command (below train/, rollout/, evaluation/ in the layering)."""
from rexrag_jax.config.gin_config import CONFIGURABLE_MODULES, GIN_DIR, parse_gin

__all__ = ["CONFIGURABLE_MODULES", "GIN_DIR", "parse_gin"]
