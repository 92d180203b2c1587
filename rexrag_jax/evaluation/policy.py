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

    _run_config(run_dir, gin_files, gin_params)
    cfg = model_config()
    from rexrag_jax.io import paths

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
    tok = _gin_value("SearchRollout.tokenizer_path", "%TOKENIZER")
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
        if not is_run_dir(checkpoint):
            raise FileNotFoundError(f"{checkpoint}: no checkpoints/<step>/ there (a gs:// --checkpoint must be a "
                                    "`rexrag train` run dir; copy an HF export to local disk)")
    elif not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"checkpoint directory not found: {checkpoint}")
    if is_run_dir(checkpoint):
        cfg, params, run_tok, step = load_run_policy(checkpoint, gin_files, gin_params)
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
                          gin_params: Sequence[str] = (), retriever_url: str | None = None, topk: int = 3,
                          max_turns: int = 5, corpus: str | None = None, index_dir: str | None = None,
                          batch_size: int = 64, max_new_tokens: int = 500, max_context: int = 4096,
                          max_obs_tokens: int = 500, progress: bool = True, retriever=None):
    """generate_fn(list[QAExample]) -> list[str]: greedy, probe-free rollouts (SPEC §1 loop; defaults are
    the paper's 500 tokens/turn, 4096 context, top-3, 5 search turns + 1 final turn).

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
    rcfg = RolloutConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, max_obs_tokens=max_obs_tokens,
                         max_context=max_context, topk=topk, greedy=True, probes=False)
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
    return generate_fn
