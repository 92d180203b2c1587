"""Host-side multi-turn rollout loop with REX-RAG probes (SPEC §1, §3).

One engine row ("slot") per live trajectory. Each turn:
  1. generate for every active row (the engine cuts right after the first complete `<search>…</search>`
     or `<answer>…</answer>` block; a stray closer such as `</answer>` inside `<think>` does not end the turn);
  2. parse each row's action with Search-R1's regex `<(search|answer)>(.*?)</\\1>` on the turn's text;
  3. send all search queries of the turn to the retriever in ONE call (top-k = config.topk);
  4. append `\\n\\n<information>{passages}</information>\\n\\n` (cut to max_obs_tokens) to search rows, or
     `\\nMy action is invalid. ` to rows with neither tag; answer rows end;
  5. probes (training only): a wrong answer of an original in a search-enabled turn is, with probability
     revision_prob, cloned: the clone's cache is the original's up to `<answer>` (no recomputation),
     one revision prompt is appended, and it continues with the remaining turns.
After max_turns search-enabled turns, rows still active get one last generation with search disabled
(as in Search-R1's "final LLM rollout": a `<search>` there is not executed and the row ends).

Left truncation (rare; Search-R1 keeps the last max_prompt_length tokens of the rolling context): the
cache has slot == RoPE position, so dropping old tokens cannot be done in place. When an append would
make a row's context exceed max_context, the row is reset and re-prefilled with
`truncate_context(context + new, prompt_len, max_context)` = prompt + the most recent tokens (the
question is never dropped unless the prompt alone is longer than max_context). Positions restart at 0,
exactly as Search-R1's left-padded recomputation. The *trajectory* keeps every token; only the
generation context is cut, so sample_logprobs of later tokens were computed on the truncated context
(the trainer recomputes log-probs on the full trajectory anyway).

Probe splice and token boundaries: the clone must contain the original's text exactly up to
`<answer>`. With a BPE tokenizer one generated token may straddle that boundary (e.g. " <"); we keep
the longest run of generated tokens whose text is a prefix of the cut text, drop the rest, and
re-append the missing characters re-tokenized (marked SEG_RESPONSE, sample_logprob 0: they are the
model's own text, not sampled in this tokenization). The revision prompt is tokenized on its own,
exactly as PromptPoolDistribution tokenizes the pool, and marked SEG_PROBE.

Probe slots (`probe_slot`): "source" (default) continues the probe in its original's row, which is
free because the original just ended: engine.truncate, no copy, never dropped, engine batch = number
of originals. "free" copies the prefix into another free row with engine.copy_prefix (rows of ended
trajectories are reused; size the engine with `required_batch_size`); with no free row the probe is
dropped and counted. Either way at most floor(max_probe_fraction * num_originals) probes are created.

EOS mid-trajectory: a turn that ends with EOS but no action continues with the invalid-action text;
the EOS token is then removed from cache and trajectory (Search-R1 decodes responses with
skip_special_tokens before continuing). A trajectory that ends on EOS keeps it.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Sequence

import gin
import jax
import numpy as np

from rexrag_jax.data.prompts import render_prompt
from rexrag_jax.retrieval.format import format_passages
from rexrag_jax.rewards.em import exact_match
from rexrag_jax.rollout.types import SEG_INFO, SEG_INVALID, SEG_PROBE, SEG_PROMPT, SEG_RESPONSE, TrajectoryBatch

_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
PROBE_SLOTS = ("source", "free")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_turns: int = 5                 # search-enabled turns; then one last turn with search disabled
    max_new_tokens: int = 500          # per turn
    max_obs_tokens: int = 500          # observation tokens kept (Search-R1 cuts the tokenized obs)
    max_context: int = 4096            # rolling context before a generation (left-truncated beyond)
    topk: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    probes: bool = True                # training: mixed sampling; evaluation: False
    revision_prob: float = 0.2
    reference_revision_bug: bool = False  # True: randint(0, 100) < round(100 p), i.e. 20/101 for p = 0.2
    max_probe_fraction: float = 1.0    # at most floor(fraction * originals) probes per rollout
    probe_slot: str = "source"         # "source" (truncate in place) | "free" (copy_prefix to a free row)
    invalid_action_text: str = "\nMy action is invalid. "
    show_progress: bool = False

    def __post_init__(self):
        for name in ("max_turns", "max_new_tokens", "max_obs_tokens", "max_context", "topk"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < (0 if name == "max_turns" else 1):
                raise ValueError(f"RolloutConfig.{name}={v!r}: expected a positive int")
        if not 0.0 <= self.revision_prob <= 1.0:
            raise ValueError(f"RolloutConfig.revision_prob={self.revision_prob}: expected a probability in [0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"RolloutConfig.top_p={self.top_p}: expected a value in (0, 1]")
        if self.max_probe_fraction < 0:
            raise ValueError(f"RolloutConfig.max_probe_fraction={self.max_probe_fraction}: expected >= 0")
        if self.probe_slot not in PROBE_SLOTS:
            raise ValueError(f"RolloutConfig.probe_slot={self.probe_slot!r}: expected one of {PROBE_SLOTS}")


# --- pure helpers ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Action:
    kind: str | None   # "search", "answer" or None (invalid)
    content: str       # stripped text between the tags ("" when invalid)
    start: int         # char index of the opening tag in the turn text (-1 when invalid)
    end: int           # char index right after the closing tag (-1 when invalid)


def parse_action(text: str) -> Action:
    """First match of Search-R1's `<(search|answer)>(.*?)</\\1>` (DOTALL) in one turn's text.

    The turn's text is what the engine kept: cut right after the first complete action block (engine
    stop_blocks, generation.stops). Search-R1 instead generates the whole turn, cuts it at the first
    `</search>` if the turn has one anywhere, else at the first `</answer>`, and then takes this regex's
    first match. The action is the same whenever the first closing tag closes a block not nested in an
    unclosed `<search>` (all well-formed turns; the reference keeps any text up to a later `</search>`
    in the turn, we do not), and when a
    stray closer is followed by a `</search>` (e.g. `<think> .. </answer> .. </think><search> q </search>`
    -> search "q" in both). They differ only on malformed turns: a stray `</answer>` followed by a
    complete `<answer> y </answer>` and no `</search>` is "answer y" here but invalid in the reference
    (cut at the stray closer), likewise a stray `</search>` before a complete block; and
    `<search> q <answer> a </answer> … </search>` is "answer a" here but a search for
    "q <answer> a </answer> …" there. `search_r1_cut` is the reference's cut, for comparison.
    """
    m = _ACTION_RE.search(text)
    if m is None:
        return Action(None, "", -1, -1)
    return Action(m.group(1), m.group(2).strip(), m.start(), m.end())


def search_r1_cut(text: str) -> str:
    """Search-R1's `_postprocess_responses` on one whole generated turn: cut after the first `</search>`
    if there is one anywhere, else after the first `</answer>`, else unchanged."""
    if "</search>" in text:
        return text.split("</search>")[0] + "</search>"
    if "</answer>" in text:
        return text.split("</answer>")[0] + "</answer>"
    return text


def format_observation(hits) -> str:
    """`\\n\\n<information>{passages}</information>\\n\\n`, passages = format_passages(hits).strip()
    (Search-R1/REX-RAG strip the passage string, dropping the last `Doc k` line's newline)."""
    return f"\n\n<information>{format_passages(hits).strip()}</information>\n\n"


def truncate_context(tokens: Sequence[int], keep_prefix: int, max_len: int) -> list[int]:
    """Left-truncate to max_len tokens keeping the first keep_prefix (the prompt):
    tokens[:keep_prefix] + tokens[-(max_len - keep_prefix):]; if keep_prefix >= max_len, tokens[-max_len:]."""
    tokens = list(tokens)
    if len(tokens) <= max_len:
        return tokens
    if keep_prefix >= max_len:
        return tokens[-max_len:]
    return tokens[:keep_prefix] + tokens[len(tokens) - (max_len - keep_prefix):]


def split_at_char(tokens: Sequence[int], target: str, decode) -> tuple[int, str]:
    """(k, rest): the largest k with decode(tokens[:k]) a prefix of `target`, and the missing tail
    target[len(decode(tokens[:k])):]. k = 0 always qualifies, so this never fails."""
    for k in range(len(tokens), -1, -1):
        text = decode(list(tokens[:k]))
        if target.startswith(text):
            return k, target[len(text):]
    raise AssertionError("unreachable: the empty prefix always matches")


def revision_draw(rng: np.random.Generator, p: float, reference_bug: bool) -> bool:
    """True with probability p; with reference_bug, randint(0, 100) < round(100 p) (= 20/101 for 0.2)."""
    if reference_bug:
        return int(rng.integers(0, 101)) < int(round(100 * p))
    return bool(rng.random() < p)


def max_probes(num_originals: int, config: RolloutConfig) -> int:
    return int(np.floor(config.max_probe_fraction * num_originals + 1e-9))


def required_batch_size(num_originals: int, config: RolloutConfig) -> int:
    """Engine rows needed so no probe is dropped for lack of a slot."""
    if not config.probes or config.probe_slot == "source":
        return num_originals
    return num_originals + max_probes(num_originals, config)


# --- the loop ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Traj:
    group_id: int
    example: object
    prompt_len: int
    tokens: list
    segments: list
    logprobs: list
    is_probe: bool = False
    probe_start: int = -1
    probe_len: int = 0
    num_searches: int = 0
    turn_start: int = 0

    def extend(self, toks, seg, logprobs=None):
        self.tokens.extend(int(t) for t in toks)
        self.segments.extend([seg] * len(toks))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(toks))


class _Rollout:
    """State of one rollout. rapo.hybrid_rollout subclasses it: keep __init__'s signature, start / turn /
    finish, _append, and the attributes B, row_traj, trajs, ctx, tok, cfg, stats, engine, prompt_note stable."""

    prompt_note = ""  # extra instruction sentence in every prompt (data.prompts.build_prompt_text); RAPO sets it

    def __init__(self, engine, tokenizer, retriever, config: RolloutConfig, pool_tokens, np_rng, num_originals):
        self.max_probes = max_probes(num_originals, config)
        self.engine, self.tok, self.retriever, self.cfg = engine, tokenizer, retriever, config
        self.pool_tokens, self.np_rng = pool_tokens, np_rng
        self.B = int(engine.batch_size)
        self.ctx: list[list[int]] = [[] for _ in range(self.B)]   # host mirror of each row's cache
        self.row_traj: list[int | None] = [None] * self.B
        self.trajs: list[_Traj] = []
        self.eos_ids = set(getattr(tokenizer, "eos_ids", [tokenizer.eos_id]))
        self.invalid_tokens = tokenizer.encode(config.invalid_action_text)
        self._splice_saved: dict[int, int] = {}   # row -> prefix tokens its probe splice reused this turn
        self.stats = dict(turns=0, searches=0, retriever_calls=0, invalid_actions=0, answers=0,
                          context_truncations=0, obs_truncated=0, eos_trimmed=0, probe_candidates=0,
                          probes_drawn=0, probes_created=0, probes_dropped_no_slot=0, probes_dropped_budget=0,
                          prefill_tokens=0, prefill_tokens_saved_by_splice=0, generated_tokens=0,
                          generate_s=0.0, retrieve_s=0.0, append_s=0.0)

    def _append(self, pending: dict[int, list[int]]):
        """Append tokens to rows (one batched engine.append); rows that would pass max_context are
        reset and re-prefilled with their truncated context (see module docstring)."""
        rows, lists = [], []
        for r, toks in pending.items():
            full = self.ctx[r] + list(toks)
            if len(full) > self.cfg.max_context:
                traj = self.trajs[self.row_traj[r]]
                full = truncate_context(full, traj.prompt_len, self.cfg.max_context)
                self.engine.reset([r])
                self.ctx[r] = []
                toks = full
                self.stats["context_truncations"] += 1
                # a probe spliced this turn is re-prefilled after all: its splice saved nothing
                self.stats["prefill_tokens_saved_by_splice"] -= self._splice_saved.pop(r, 0)
            self.ctx[r] = full
            if toks:
                rows.append(r)
                lists.append(list(toks))
        self._splice_saved.clear()
        if rows:
            t0 = time.perf_counter()
            self.engine.append(rows, lists)
            self.stats["append_s"] += time.perf_counter() - t0
            self.stats["prefill_tokens"] += sum(len(x) for x in lists)

    def _check_lengths(self):
        lengths = np.asarray(self.engine.lengths())
        for r in range(self.B):
            if self.row_traj[r] is not None and lengths[r] != len(self.ctx[r]):
                raise RuntimeError(f"rollout: engine row {r} holds {lengths[r]} tokens but the rollout expects "
                                   f"{len(self.ctx[r])}; the engine and the loop disagree")

    def start(self, examples, group_size):
        pending = {}
        for i, ex in enumerate(examples):
            ptoks = self.tok.encode(render_prompt(self.tok, ex.question, self.prompt_note))
            for _ in range(group_size):
                r = len(self.trajs)
                self.trajs.append(_Traj(group_id=i, example=ex, prompt_len=len(ptoks), tokens=list(ptoks),
                                        segments=[SEG_PROMPT] * len(ptoks), logprobs=[0.0] * len(ptoks)))
                self.row_traj[r] = r
                pending[r] = ptoks
        self._append(pending)

    def turn(self, turn: int, rng):
        cfg, final = self.cfg, turn == self.cfg.max_turns
        rows = [r for r in range(self.B) if self.row_traj[r] is not None]
        if not rows:
            return False
        self._check_lengths()
        t0 = time.perf_counter()
        outs = self.engine.generate(rows, cfg.max_new_tokens, rng, temperature=cfg.temperature, top_p=cfg.top_p,
                                    greedy=cfg.greedy)
        self.stats["generate_s"] += time.perf_counter() - t0
        self.stats["turns"] += 1
        acts = {}
        for r, out in zip(rows, outs):
            traj = self.trajs[self.row_traj[r]]
            toks, lps = list(out.tokens), list(out.logprobs)
            act = parse_action(out.text)
            continues = not final and act.kind != "answer"
            if continues and toks and out.stop_reason == "eos" and toks[-1] in self.eos_ids:
                self.engine.truncate(r, len(self.ctx[r]) + len(toks) - 1)
                toks, lps = toks[:-1], lps[:-1]
                self.stats["eos_trimmed"] += 1
            traj.turn_start = len(traj.tokens)
            traj.extend(toks, SEG_RESPONSE, [float(x) for x in lps])
            self.ctx[r] = self.ctx[r] + toks
            self.stats["generated_tokens"] += len(toks)
            acts[r] = (act, out.text, toks)

        search_rows = [] if final else [r for r in rows if acts[r][0].kind == "search"]
        hits = {}
        if search_rows:
            t0 = time.perf_counter()
            results = self.retriever.search([acts[r][0].content for r in search_rows], cfg.topk)
            self.stats["retrieve_s"] += time.perf_counter() - t0
            self.stats["retriever_calls"] += 1
            if len(results) != len(search_rows):
                raise RuntimeError(f"retriever returned {len(results)} result lists for {len(search_rows)} queries")
            texts = [format_observation(h) for h in results]
            encode_batch = getattr(self.tok, "encode_batch", None)  # HF tokenizers encode in parallel
            encoded = encode_batch(texts) if encode_batch else [self.tok.encode(t) for t in texts]
            hits = dict(zip(search_rows, encoded))

        pending, candidates = {}, []
        for r in rows:
            act, text, toks = acts[r]
            idx = self.row_traj[r]
            traj = self.trajs[idx]
            if act.kind == "answer":
                self.stats["answers"] += 1
                self.row_traj[r] = None
                if cfg.probes and not final and not traj.is_probe:
                    if exact_match(act.content, traj.example.golden_answers) < 1.0:
                        self.stats["probe_candidates"] += 1
                        if revision_draw(self.np_rng, cfg.revision_prob, cfg.reference_revision_bug):
                            self.stats["probes_drawn"] += 1
                            candidates.append((r, idx, act, text, toks))
            elif final:
                self.row_traj[r] = None
            elif act.kind == "search":
                obs = list(hits[r])
                if len(obs) > cfg.max_obs_tokens:
                    obs = obs[: cfg.max_obs_tokens]
                    self.stats["obs_truncated"] += 1
                traj.extend(obs, SEG_INFO)
                traj.num_searches += 1
                self.stats["searches"] += 1
                pending[r] = obs
            else:
                traj.extend(self.invalid_tokens, SEG_INVALID)
                self.stats["invalid_actions"] += 1
                pending[r] = self.invalid_tokens

        waiting = {c[0] for c in candidates}  # sources whose cache is still needed
        for r, idx, act, text, toks in candidates:
            waiting.discard(r)
            if self.stats["probes_created"] >= self.max_probes:
                self.stats["probes_dropped_budget"] += 1
                continue
            if cfg.probe_slot == "source":
                dst = r
            else:
                free = [x for x in range(self.B) if self.row_traj[x] is None and x != r and x not in waiting]
                if not free:
                    self.stats["probes_dropped_no_slot"] += 1
                    continue
                dst = free[0]
            self._make_probe(r, dst, idx, act, text, toks, pending)
        self._append(pending)
        return True

    def _make_probe(self, src, dst, idx, act, text, toks, pending):
        orig = self.trajs[idx]
        k, partial = split_at_char(toks, text[: act.start], self.tok.decode)
        cache_len = len(self.ctx[src]) - (len(toks) - k)
        if dst == src:
            self.engine.truncate(src, cache_len)
        else:
            self.engine.copy_prefix(src, dst, cache_len)
        self.ctx[dst] = self.ctx[src][:cache_len]
        keep = orig.turn_start + k
        probe = _Traj(group_id=orig.group_id, example=orig.example, prompt_len=orig.prompt_len,
                      tokens=orig.tokens[:keep], segments=orig.segments[:keep], logprobs=orig.logprobs[:keep],
                      is_probe=True, num_searches=orig.num_searches)
        partial_tokens = self.tok.encode(partial) if partial else []
        probe.extend(partial_tokens, SEG_RESPONSE)
        prompt = self.pool_tokens[int(self.np_rng.integers(len(self.pool_tokens)))]
        probe.probe_start, probe.probe_len = len(probe.tokens), len(prompt)
        probe.extend(prompt, SEG_PROBE)
        self.trajs.append(probe)
        self.row_traj[dst] = len(self.trajs) - 1
        pending[dst] = partial_tokens + list(prompt)
        self.stats["probes_created"] += 1
        self.stats["prefill_tokens_saved_by_splice"] += cache_len
        self._splice_saved[dst] = cache_len

    def finish(self) -> TrajectoryBatch:
        records = []
        for t in self.trajs:
            records.append(dict(tokens=t.tokens, segments=t.segments, logprobs=t.logprobs, group_id=t.group_id,
                                is_probe=t.is_probe, probe_start=t.probe_start, probe_len=t.probe_len,
                                num_searches=t.num_searches, example=t.example,
                                response_text=self.tok.decode(t.tokens[t.prompt_len:])))
        return TrajectoryBatch.from_records(records, pad_id=int(self.tok.pad_id))


def _host_rng(rng) -> tuple[jax.Array, np.random.Generator]:
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    rng, host = jax.random.split(rng)
    seed = np.asarray(jax.random.randint(host, (), 0, np.iinfo(np.int32).max))
    return rng, np.random.default_rng(int(seed))


def run_rollouts(engine, tokenizer, retriever, examples: Sequence, group_size: int, rng,
                 config: RolloutConfig | None = None, prompt_pool: Sequence[str] | None = None):
    """Roll out `group_size` trajectories per example (group id = example index) plus probes.

    engine: GenerationEngine-like (append / generate / copy_prefix / truncate / lengths / reset,
      batch_size, max_len); it is reset first. Needs batch_size >= N = len(examples) * group_size
      (required_batch_size(N, config) rows guarantee no probe is dropped for lack of a slot) and
      max_len >= max_context + max_new_tokens.
    retriever: `.search(queries, topk) -> [[{"document": {"id", "contents"}, "score"}]]`.
    rng: a jax PRNG key (or an int seed) driving sampling, probe draws and prompt choice.
    prompt_pool: revision prompts (default: rexrag_jax.rl.prompt_pool.revision_prompts(), gin-configurable).

    Returns (TrajectoryBatch with originals first (row i*group_size + j), then probes in creation
    order; stats dict of counts and timings).
    """
    config = config or RolloutConfig()
    examples = list(examples)
    if group_size < 1 or not examples:
        raise ValueError(f"run_rollouts: need >= 1 example and group_size >= 1, got {len(examples)}, {group_size}")
    n = len(examples) * group_size
    if engine.batch_size < n:
        raise ValueError(f"run_rollouts: engine.batch_size={engine.batch_size} < {n} originals "
                         f"({len(examples)} examples x group_size {group_size}); with probe_slot='free' size it "
                         f"with required_batch_size (= {required_batch_size(n, config)}) so no probe is dropped")
    max_len = getattr(engine, "max_len", None)
    if max_len is not None and max_len < config.max_context + config.max_new_tokens:
        raise ValueError(f"run_rollouts: engine.max_len={max_len} < max_context + max_new_tokens = "
                         f"{config.max_context + config.max_new_tokens}")
    if prompt_pool is None:
        from rexrag_jax.rl.prompt_pool import revision_prompts
        prompt_pool = revision_prompts()
    pool_tokens = [tokenizer.encode(p) for p in prompt_pool]
    if config.probes and (not pool_tokens or not all(pool_tokens)):
        raise ValueError("run_rollouts: prompt_pool must hold non-empty prompts when config.probes is True")

    t_start = time.perf_counter()
    rng, np_rng = _host_rng(rng)
    engine.reset()
    ro = _Rollout(engine, tokenizer, retriever, config, pool_tokens, np_rng, n)
    ro.start(examples, group_size)
    turns = range(config.max_turns + 1)
    if config.show_progress:
        from tqdm import tqdm
        turns = tqdm(turns, desc="rollout turns", leave=False)
    for turn in turns:
        if not ro.turn(turn, jax.random.fold_in(rng, turn)):
            break
    batch = ro.finish()
    stats = dict(ro.stats)
    stats.update(num_originals=n, num_probes=int(batch.is_probe.sum()), total_s=time.perf_counter() - t_start,
                 mean_response_tokens=float(batch.loss_mask.sum(axis=1).mean()) if batch.size else 0.0)
    return batch, stats
