"""generate_fn for `rexrag eval`: a policy + retriever -> greedy, probe-free multi-turn rollouts.

    fn = make_eval_generate_fn(checkpoint="runs/x/final_model", corpus="wiki18.jsonl")
    responses = fn(examples)     # list[QAExample] -> list[str] (turns + observations, no prompt)

Policy sources (`checkpoint`):
  * an HF-format Qwen2 directory (config.json + *.safetensors), loaded with models.qwen2.hf_io; the
    tokenizer defaults to the same directory (tokenizer.json or one SentencePiece *.model);
  * a trainer run directory (`rexrag train --run_dir`, i.e. holding checkpoints/<step>/): the model
    config, optimizer and tokenizer come from the run's operative_config.gin (else config.gin), and the
    latest (or `step`) orbax checkpoint is restored with train.checkpoint.Checkpointer.restore. That
    public function restores params *and* optimizer state (Adam moments: ~3x the params' memory on the
    host for a moment); only the params are kept. A run dir may be a gs:// URL (rexrag_jax.io.paths:
    its gin is read through a local copy, orbax restores from the bucket).
Retriever: `retriever_url` (Search-R1 POST /retrieve server, HttpRetriever), else `corpus` (in-process
MiniLM + exact/ScaNN index via build_default_retriever, cached in `index_dir`; both may be gs://).

Vocabulary guard: Qwen2 checkpoints pad the embedding beyond the tokenizer (151936 rows vs 151665 ids),
and the engine samples over all rows. Ids >= the tokenizer's vocab cannot be decoded, so the policy is
cut to the tokenizer's vocab before it reaches the engine (embed[:V_tok], lm_head[:, :V_tok]): prompts
never contain those ids, and softmax/argmax over the remaining logits is exactly the masked
distribution (log p_masked(i) = z_i - logsumexp_{j < V_tok} z_j).
"""
from __future__ import annotations

import glob
import os
from typing import Sequence

DEFAULT_INDEX_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "rexrag_jax", "eval_index")


def is_run_dir(path: str) -> bool:
    """True for a trainer run dir (checkpoints/<int>/ inside, local or gs://), False for an HF export."""
    from rexrag_jax.io import paths

    return any(d.isdigit() for d in paths.listdir(paths.join(path, "checkpoints")))


def trainer_run_dir(path: str) -> str | None:
    """The trainer run dir `path` names: itself (`rexrag train --run_dir`, the demo's RUN/rl), or RUN/rl for a
    `rexrag demo` run dir; None for anything else (an HF export)."""
    from rexrag_jax.io import paths

    if is_run_dir(path):
        return path
    rl = paths.join(path, "rl")
    return rl if is_run_dir(rl) else None


def read_policy_record(run_dir: str) -> dict | None:
    """<run_dir>/policy.json (written by the Trainer: model config, tokenizer, rollout settings), or None."""
    from rexrag_jax.io import paths

    path = paths.join(run_dir, "policy.json")
    if not paths.isfile(path):
        return None
    rec = paths.read_json(path)
    if not isinstance(rec, dict) or "model_config" not in rec:
        raise ValueError(f"{path}: expected a policy record with model_config (written by the Trainer)")
    return rec


# `rexrag eval` rollout settings: an explicit flag wins, then the run's training value, then these (the
# paper's evaluation: 500 tokens/turn, 4096 context, top-3, 5 search turns).
ROLLOUT_DEFAULTS = {"topk": 3, "max_turns": 5, "max_new_tokens": 500, "max_context": 4096, "max_obs_tokens": 500}


def run_rollout_settings(run_dir: str | None) -> dict:
    """The rollout settings a trainer run dir trained with (ROLLOUT_DEFAULTS keys): policy.json's rollout,
    else the RolloutConfig bound in the gin config parsed from the run (load_run_policy); {} when none."""
    if run_dir is None:
        return {}
    rec = read_policy_record(run_dir)
    if rec is not None and rec.get("rollout"):
        return {k: rec["rollout"][k] for k in ROLLOUT_DEFAULTS if k in rec["rollout"]}
    import gin

    out = {}
    for k in ROLLOUT_DEFAULTS:
        try:
            out[k] = gin.query_parameter(f"RolloutConfig.{k}")
        except (ValueError, KeyError):
            continue
    return {k: v for k, v in out.items() if isinstance(v, int)}


def resolve_rollout_settings(explicit: dict, trained: dict) -> tuple[dict, dict]:
    """(settings, source per key: "flag" / "run" / "default") for the ROLLOUT_DEFAULTS keys."""
    settings, source = {}, {}
    for k, default in ROLLOUT_DEFAULTS.items():
        if explicit.get(k) is not None:
            settings[k], source[k] = int(explicit[k]), "flag"
        elif k in trained:
            settings[k], source[k] = int(trained[k]), "run"
        else:
            settings[k], source[k] = default, "default"
    return settings, source


def check_model_limits(cfg, max_context: int, max_new_tokens: int, checkpoint: str) -> None:
    """ValueError (one line) when a rollout would use positions beyond the model's max_position_embeddings."""
    need = int(max_context) + int(max_new_tokens)
    if need > cfg.max_position_embeddings:
        raise ValueError(f"--max-context {max_context} + --max-new-tokens {max_new_tokens} = {need} positions, beyond "
                         f"the model's max_position_embeddings {cfg.max_position_embeddings} ({checkpoint}); lower them")


def restrict_vocab(params: dict, cfg, vocab_size: int):
    """(params, cfg) with the vocabulary cut to the first `vocab_size` ids (see the module docstring).

    embed [V, D] -> [vocab_size, D]; lm_head [D, V] -> [D, vocab_size] when untied. Unchanged when
    vocab_size == cfg.vocab_size; a tokenizer larger than the model is an error (its ids have no row)."""
    import dataclasses

    if vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer vocab {vocab_size} > model vocab {cfg.vocab_size}: the tokenizer does not "
                         "belong to this checkpoint")
    if vocab_size == cfg.vocab_size:
        return params, cfg
    params = dict(params)
    params["embed"] = params["embed"][:vocab_size]
    if "lm_head" in params:
        params["lm_head"] = params["lm_head"][:, :vocab_size]
    return params, dataclasses.replace(cfg, vocab_size=vocab_size)


def _run_config(run_dir: str, gin_files: Sequence[str], gin_params: Sequence[str]):
    """Parse the run's gin (operative_config.gin, else config.gin, unless gin_files are given)."""
    import tempfile

    from rexrag_jax.config import parse_gin
    from rexrag_jax.io import paths

    files = list(gin_files)
    with tempfile.TemporaryDirectory(prefix="rexrag-eval-gin-") as tmp:
        if not files:
            for name in ("operative_config.gin", "config.gin"):
                path = paths.join(run_dir, name)
                if paths.isfile(path):
                    if paths.is_remote(path):  # gin opens local files: a gs:// run's config is read via a copy
                        paths.download_file(path, os.path.join(tmp, name))
                        path = os.path.join(tmp, name)
                    files = [path]
                    break
            else:
                raise FileNotFoundError(f"{run_dir}: a run directory needs operative_config.gin or config.gin (the "
                                        "model config), or pass --gin-file")
        parse_gin(files, list(gin_params))


def _gin_value(*names):
    import gin

    for name in names:
        try:
            v = gin.query_parameter(name)
        except (ValueError, KeyError):
            continue
        if isinstance(v, str) or v is None:
            return v
        if getattr(v, "selector", None) == "gin.macro":  # `SearchRollout.tokenizer_path = %TOKENIZER`
            try:
                v = gin.query_parameter("%" + "/".join(v.scopes))
            except (ValueError, KeyError):
                continue
        if isinstance(v, str) or v is None:
            return v
    return None


def load_run_policy(run_dir: str, gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
                    step: int | None = None):
    """(cfg, params, tokenizer_path | None, step) from a trainer run dir's orbax checkpoint."""
    import jax

    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.models.qwen2.config import model_config
    from rexrag_jax.train.checkpoint import Checkpointer
    from rexrag_jax.train.optim import OptimizerConfig

    from rexrag_jax.io import paths
    from rexrag_jax.models.qwen2.config import Qwen2Config

    rec = None if gin_files else read_policy_record(run_dir)
    if rec is not None:  # the Trainer's record: no gin needed (the demo's rl/ has none)
        from rexrag_jax.config import parse_gin

        parse_gin([], list(gin_params))
        cfg = Qwen2Config(**rec["model_config"])
    else:
        _run_config(run_dir, gin_files, gin_params)
        cfg = model_config()

    ckpt = Checkpointer(paths.join(run_dir, "checkpoints"))  # a local path or gs:// (orbax reads either)
    try:
        step = ckpt.latest_step() if step is None else int(step)
        if step is None or step not in ckpt.all_steps():
            raise FileNotFoundError(f"{run_dir}/checkpoints: no checkpoint step {step} (have {ckpt.all_steps()})")
        params_like = jax.eval_shape(lambda k: qwen2.init_params(cfg, k), jax.random.PRNGKey(0))
        like = {"params": params_like, "opt_state": jax.eval_shape(OptimizerConfig().make().init, params_like)}
        state, _ = ckpt.restore(step, like)
    finally:
        ckpt.close()
    tok = rec.get("tokenizer") if rec is not None else _gin_value("SearchRollout.tokenizer_path", "%TOKENIZER")
    return cfg, state["params"], tok, step


def load_policy(checkpoint: str, tokenizer: str | None = None, gin_files: Sequence[str] = (),
                gin_params: Sequence[str] = (), progress: bool = True):
    """(cfg, params, Tokenizer) from an HF dir or a run dir, vocab restricted to the tokenizer's."""
    from rexrag_jax.models.qwen2.hf_io import load_checkpoint
    from rexrag_jax.tokenizers import load_tokenizer

    from rexrag_jax.io import paths

    if not checkpoint:
        raise ValueError("model evaluation needs --checkpoint (an HF-format Qwen2 dir or a `rexrag train` run dir)")
    if paths.is_remote(checkpoint):  # a gs:// run dir (bucket checked: one-line RemotePathError)
        paths.check_remote_dir(checkpoint)
        if trainer_run_dir(checkpoint) is None:
            raise FileNotFoundError(f"{checkpoint}: no checkpoints/<step>/ there (a gs:// --checkpoint must be a "
                                    "`rexrag train` run dir; copy an HF export to local disk)")
    elif not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"checkpoint directory not found: {checkpoint}")
    run_dir = trainer_run_dir(checkpoint)
    if run_dir is not None:
        cfg, params, run_tok, step = load_run_policy(run_dir, gin_files, gin_params)
        tokenizer = tokenizer or run_tok
        if not tokenizer:
            raise ValueError(f"{checkpoint}: the run's gin binds no tokenizer (SearchRollout.tokenizer_path / "
                             "TOKENIZER); pass --tokenizer")
    else:
        if not glob.glob(os.path.join(checkpoint, "*.safetensors")):
            raise FileNotFoundError(f"{checkpoint}: neither an HF export (config.json + *.safetensors) nor a run dir "
                                    "(checkpoints/<step>/)")
        if gin_files or gin_params:  # e.g. RolloutConfig overrides; the model comes from config.json
            import gin
            gin.parse_config_files_and_bindings(list(gin_files), list(gin_params), finalize_config=False)
        cfg, params = load_checkpoint(checkpoint, progress=progress)
    tok = load_tokenizer(tokenizer or checkpoint)
    params, cfg = restrict_vocab(params, cfg, tok.vocab_size)
    return cfg, params, tok


def make_retriever(retriever_url: str | None = None, corpus: str | None = None, index_dir: str | None = None,
                   progress: bool = True):
    """HttpRetriever(retriever_url), else the in-process MiniLM retriever over `corpus`."""
    from rexrag_jax.retrieval import HttpRetriever, build_default_retriever

    if retriever_url:
        return HttpRetriever(retriever_url)
    if not corpus:
        raise ValueError("model evaluation needs a retriever: --retriever-url URL (rexrag serve-retriever) or "
                         "--corpus CORPUS.jsonl (in-process MiniLM index)")
    from rexrag_jax.io import paths

    if not paths.isfile(corpus):  # a local path or gs:// (so may be --index-dir)
        raise FileNotFoundError(f"corpus not found: {corpus}")
    if index_dir is None:  # one cache per corpus file (the index checks it was built from this exact corpus)
        stem = paths.as_str(corpus).replace("://", "_").strip(os.sep).replace(os.sep, "_").replace(".", "_")
        index_dir = os.path.join(DEFAULT_INDEX_ROOT, stem)
    return build_default_retriever(corpus, index_dir, progress=progress)


def make_eval_generate_fn(checkpoint: str, tokenizer: str | None = None, gin_files: Sequence[str] = (),
                          gin_params: Sequence[str] = (), retriever_url: str | None = None,
                          topk: int | None = None, max_turns: int | None = None, corpus: str | None = None,
                          index_dir: str | None = None, batch_size: int = 64, max_new_tokens: int | None = None,
                          max_context: int | None = None, max_obs_tokens: int | None = None, progress: bool = True,
                          retriever=None):
    """generate_fn(list[QAExample]) -> list[str]: greedy, probe-free rollouts (SPEC §1 loop).

    Rollout settings (topk, max_turns, max_new_tokens, max_context, max_obs_tokens): a value given here wins;
    None takes the value a trainer run dir (or a demo run dir's rl/) trained with (its policy.json, else its
    gin RolloutConfig), else the paper's (ROLLOUT_DEFAULTS: 500 tokens/turn, 4096 context, top-3, 5 search
    turns + 1 final turn). max_context + max_new_tokens beyond the model's max_position_embeddings is refused.
    `generate_fn.settings` / `.settings_source` record what was used.

    The engine holds `batch_size` rows; larger lists are run in chunks of batch_size. `retriever` (any
    `.search(queries, topk)` object) overrides retriever_url/corpus.
    """
    import jax
    from tqdm.auto import tqdm

    from rexrag_jax.generation.engine import GenerationEngine
    from rexrag_jax.rollout.loop import RolloutConfig, run_rollouts

    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    retriever = retriever or make_retriever(retriever_url, corpus, index_dir, progress)  # cheap errors first
    cfg, params, tok = load_policy(checkpoint, tokenizer, gin_files, gin_params, progress)
    explicit = dict(topk=topk, max_turns=max_turns, max_new_tokens=max_new_tokens, max_context=max_context,
                    max_obs_tokens=max_obs_tokens)
    settings, source = resolve_rollout_settings(explicit, run_rollout_settings(trainer_run_dir(checkpoint)))
    check_model_limits(cfg, settings["max_context"], settings["max_new_tokens"], checkpoint)
    max_context, max_new_tokens = settings["max_context"], settings["max_new_tokens"]
    rcfg = RolloutConfig(greedy=True, probes=False, **settings)
    engine = GenerationEngine(params, cfg, batch_size=batch_size, max_len=max_context + max_new_tokens,
                              pad_id=tok.pad_id, eos_ids=tok.eos_ids, detokenize=tok.decode)

    def generate_fn(examples) -> list[str]:
        examples, out = list(examples), []
        chunks = range(0, len(examples), batch_size)
        for lo in tqdm(chunks, desc="rollout batches", leave=False, disable=not progress or len(chunks) < 2):
            part = examples[lo:lo + batch_size]
            batch, _ = run_rollouts(engine, tok, retriever, part, 1, jax.random.PRNGKey(0), rcfg)
            out.extend(batch.response_text[:len(part)])  # originals come first, in order
        return out

    generate_fn.engine, generate_fn.tokenizer, generate_fn.model_cfg = engine, tok, cfg
    generate_fn.settings, generate_fn.settings_source = settings, source
    return generate_fn
