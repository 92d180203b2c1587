"""gin parsing, t5x style: `--gin_file` paths tried as given, then under the repository's gin/ directory.

The modules that register configurables are named here as data (CONFIGURABLE_MODULES) and imported by
name when a config is parsed, so this module imports no upper layer and every command (train, eval, the
rollout's evaluation helpers) parses configs the same way without importing each other.
"""
from __future__ import annotations

import importlib
import os
import pathlib
from typing import Sequence

import gin

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin"

# Every module with @gin.configurable symbols that the project's gin files may name.
CONFIGURABLE_MODULES = (
    "rexrag_jax.models.qwen2.config",      # model_config
    "rexrag_jax.rl.prompt_pool",           # revision_prompts
    "rexrag_jax.rollout.loop",             # RolloutConfig
    "rexrag_jax.train.rollout_source",     # SearchRollout, http_retriever, local_retriever
    "rexrag_jax.train.synthetic",          # SyntheticRollout
    "rexrag_jax.train.trainer",            # Trainer, TrainConfig, qa_examples
    "rexrag_jax.train.optim",              # OptimizerConfig
    "rexrag_jax.train.main",               # run_type
)


def register_configurables() -> None:
    for name in CONFIGURABLE_MODULES:
        importlib.import_module(name)


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> None:
    """Register the configurables, then parse `gin_files` (each as given, else under gin/) and bindings."""
    register_configurables()
    gin.add_config_file_search_path(str(GIN_DIR))
    files = []
    for f in gin_files:
        if not os.path.exists(f) and (GIN_DIR / f).exists():
            f = str(GIN_DIR / f)
        files.append(f)
    gin.parse_config_files_and_bindings(files, list(gin_bindings), finalize_config=False)
