"""Static RAPO trace buffer (SPEC §8, the paper's): built offline by a stronger policy, checked at load.

Build (`rexrag build-trace-buffer`, rapo/build_cli.py): for every training question the stronger policy
samples N trajectories (paper: 16), each is scored with the project's reward (rewards.compute_reward,
binary EM of the last answer unless a format score is given), and the top K (paper: 5) are kept.
Ties are broken by sample order (a stable sort on -reward: among equal rewards the earlier sample wins;
the N samples are i.i.d., so this is a uniformly random choice among the tied ones, reproducibly).
`min_reward` (default None: the paper's literal rule) drops kept trajectories below it. Every step of a
kept trajectory is stored as key = `history_key(question, trajectory text before the step)` (the
text the hybrid rollout embeds for its lookup) and value = the step with its observation.

Layout of the buffer directory (a local path or a gs:// URL, through rexrag_jax.io.paths):
```
manifest.json     format, encoder {name, dim, max_length}, world {id, questions, ...}, policy, n, k,
                  tie_break, min_reward, history_chars, counts, rewards (written last: "finished")
steps.jsonl       one step per line: qid, question, sample, rank, reward, step, kind, insertable, key, value
embeddings.npy    float32 [count, dim], unit-norm key embeddings, row i = line i of steps.jsonl
```
While building: `build_state.json` (the build's settings) and `shards/shard-NNNNN.{npy,jsonl}`, one
pair per `shard_size` questions, each file written atomically (local: temp file + rename; GCS: one
upload), the .jsonl last, so a shard is finished iff its .jsonl exists. A re-run with the same settings
skips the finished shards (stray temp files and a shard with only its .npy are redone); other
settings are refused (one line naming the field and --overwrite). A finished buffer (manifest.json
present) is refused unless `overwrite`. Finishing concatenates the shards, writes the manifest last and
removes the shards.

World id: sha256 of the questions file's questions (id, question, golden answers; sorted by id, so
independent of file format and order). The RAPO trainer computes it over its own training questions
and refuses a buffer built for another question set.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tempfile
import time
from typing import Callable, Sequence

import numpy as np

from rexrag_jax.config.errors import StartupInputError
from rexrag_jax.io import paths
from rexrag_jax.rapo.trace_buffer import TraceBuffer
from rexrag_jax.rewards.reward import compute_reward

FORMAT_VERSION = 1
MANIFEST, STEPS, EMB, STATE, SHARDS = "manifest.json", "steps.jsonl", "embeddings.npy", "build_state.json", "shards"
TIE_BREAK = "sample_order"


class TraceBufferError(StartupInputError):
    """A buffer directory that is missing, unfinished, empty, or built for another encoder/world."""


@dataclasses.dataclass
class Candidate:
    """One sampled trajectory: the text after the prompt (what the reward reads), its steps as
    (key, value) pairs, and the tool calls it made."""
    response: str
    steps: list[tuple[str, str]]
    num_searches: int = 0


# sampler(examples, n, seed, start_index) -> per example, n Candidates. start_index is the global index of
# examples[0] in the questions list (samplers seed per question from it, so results do not depend on shards).
Sampler = Callable[[Sequence, int, int, int], list[list[Candidate]]]


def questions_fingerprint(examples) -> str:
    """sha256 over the questions (id, question, golden answers), sorted by id: the buffer's world id."""
    rows = sorted((str(e.id), e.question, list(e.golden_answers)) for e in examples)
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n")
    return h.hexdigest()


def encoder_description(encode_fn) -> dict:
    """{"name", "dim", "max_length"} of an encode function (dim probed by encoding one text)."""
    dim = int(np.asarray(encode_fn(["probe"]), np.float32).shape[1])
    return {"name": getattr(encode_fn, "encoder_name", "custom"), "dim": dim,
            "max_length": getattr(encode_fn, "max_length", None)}


def select_top_k(rewards: Sequence[float], k: int, min_reward: float | None = None) -> list[int]:
    """Indices of the top k rewards, best first; ties: the earlier sample first (stable sort).
    With min_reward, kept samples below it are dropped (so fewer than k may remain)."""
    r = np.asarray(rewards, np.float64)
    order = np.argsort(-r, kind="stable")[:k]
    return [int(i) for i in order if min_reward is None or r[i] >= min_reward]


def step_kind(step: str) -> str:
    from rexrag_jax.rollout.loop import parse_action

    return parse_action(step).kind or "invalid"


def select_and_split(example, candidates: Sequence[Candidate], k: int, min_reward: float | None = None,
                     structure_format_score: float = 0.0) -> tuple[list[dict], list[float]]:
    """(step records of the top-k candidates, every candidate's reward)."""
    from rexrag_jax.rapo.hybrid_rollout import insertable

    rewards = [compute_reward(c.response, example.golden_answers, structure_format_score) for c in candidates]
    records = []
    for rank, j in enumerate(select_top_k(rewards, k, min_reward)):
        for t, (key, value) in enumerate(candidates[j].steps):
            records.append({"qid": str(example.id), "question": example.question, "sample": j, "rank": rank,
                            "reward": float(rewards[j]), "step": t, "kind": step_kind(value),
                            "insertable": bool(insertable(value)), "num_searches": int(candidates[j].num_searches),
                            "key": key, "value": value})
    return records, [float(x) for x in rewards]


# --- file helpers (local: temp file + rename; gs://: one upload) -------------------------------------------
def _write_bytes_atomic(path: str, data: bytes) -> None:
    if paths.is_remote(path):
        with paths.open_file(path, "wb") as f:
            f.write(data)
        return
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _npy_bytes(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, np.asarray(a, np.float32))
    return b.getvalue()


def _read_npy(path: str) -> np.ndarray:
    with paths.open_file(path, "rb") as f:
        return np.load(io.BytesIO(f.read()))


def _jsonl(records) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in paths.read_text(path).splitlines() if line.strip()]


def _encode_unique(encode_fn, keys: list[str], dim: int) -> np.ndarray:
    """Embeddings [len(keys), dim], each distinct key encoded once (the top K of a question often share
    their first steps' histories)."""
    if not keys:
        return np.zeros((0, dim), np.float32)
    uniq = list(dict.fromkeys(keys))
    e = np.asarray(encode_fn(uniq), np.float32)
    if e.shape != (len(uniq), dim):
        raise ValueError(f"build-trace-buffer: the encoder returned {e.shape} for {len(uniq)} keys; expected "
                         f"({len(uniq)}, {dim})")
    where = {key: i for i, key in enumerate(uniq)}
    return e[[where[key] for key in keys]]


def shard_name(s: int) -> str:
    return f"shard-{s:05d}"


def _shard_done(out: str, s: int) -> bool:
    base = paths.join(out, SHARDS, shard_name(s))
    return paths.isfile(base + ".jsonl") and paths.isfile(base + ".npy")


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return out


def build_trace_buffer(out_dir: str, examples: Sequence, sampler: Sampler, encode_fn, *, n: int = 16, k: int = 5,
                       shard_size: int = 64, seed: int = 0, overwrite: bool = False, min_reward: float | None = None,
                       structure_format_score: float = 0.0, history_chars: int = 1000,
                       world: dict | None = None, policy: dict | None = None, num_questions: int | None = None,
                       progress: bool = True, log=print) -> dict:
    """Build (or resume) the static buffer for `examples[:num_questions]` in `out_dir`; returns the manifest.

    `world` must hold "id" (questions_fingerprint of the whole questions file; default: of `examples`) and
    may hold more (questions path, corpus); `policy` describes the stronger agent (recorded, and part of
    the resume check). Raises TraceBufferError for a finished buffer without `overwrite`, or a partial
    build with other settings.
    """
    if n < 1 or not 1 <= k <= n:
        raise TraceBufferError(f"build-trace-buffer: n={n}, k={k}; expected n >= 1 and 1 <= k <= n")
    if shard_size < 1:
        raise TraceBufferError(f"build-trace-buffer: shard_size={shard_size}; expected >= 1")
    t0 = time.perf_counter()
    out = paths.as_str(out_dir).rstrip("/")
    examples = list(examples)
    world = dict(world or {})
    world.setdefault("id", questions_fingerprint(examples))
    todo = examples[:num_questions] if num_questions else examples
    if not todo:
        raise TraceBufferError(f"build-trace-buffer: no questions to process (world {world.get('questions', '')})")
    if paths.isfile(paths.join(out, MANIFEST)):
        if not overwrite:
            raise TraceBufferError(f"{out}: a finished trace buffer is already there ({MANIFEST}); "
                                   "pass --overwrite to rebuild it")
        paths.remove_tree(out)
    enc = encoder_description(encode_fn)
    key = {"format": FORMAT_VERSION, "encoder": enc, "world": world, "policy": dict(policy or {}), "n": n, "k": k,
           "shard_size": shard_size, "seed": seed, "min_reward": min_reward, "history_chars": history_chars,
           "structure_format_score": structure_format_score, "questions": len(todo), "tie_break": TIE_BREAK}
    key = json.loads(json.dumps(key))  # the form it has once read back (tuples -> lists)
    state_path = paths.join(out, STATE)
    if paths.isfile(state_path):
        old = paths.read_json(state_path).get("key", {})
        if old != key:
            if not overwrite:
                raise TraceBufferError(f"{state_path}: a partial build with other settings ({'; '.join(_diff(old, key))}); "
                                       "pass --overwrite to start over")
            paths.remove_tree(out)
    if not paths.isfile(state_path):
        paths.makedirs(out)
        paths.write_json_atomic(state_path, {"key": key, "created_unix": int(time.time())}, indent=2, sort_keys=True)
    num_shards = -(-len(todo) // shard_size)
    done = [s for s in range(num_shards) if _shard_done(out, s)]
    if done and progress:
        log(f"resuming {out}: {len(done)} of {num_shards} shard(s) already built")
    for s in range(num_shards):
        if s in done:
            continue
        lo, hi = s * shard_size, min(len(todo), (s + 1) * shard_size)
        part = todo[lo:hi]
        cands = sampler(part, n, seed, lo)
        if len(cands) != len(part) or any(len(c) != n for c in cands):
            raise ValueError(f"build-trace-buffer: the sampler returned {[len(c) for c in cands]} candidates for "
                             f"{len(part)} questions; expected {n} each")
        records, rewards = [], []
        for ex, cs in zip(part, cands):
            recs, rs = select_and_split(ex, cs, k, min_reward, structure_format_score)
            records += recs
            rewards.append(rs)
        emb = _encode_unique(encode_fn, [r["key"] for r in records], enc["dim"])
        base = paths.join(out, SHARDS, shard_name(s))
        _write_bytes_atomic(base + ".npy", _npy_bytes(emb))
        meta = {"shard": s, "questions": [str(e.id) for e in part], "rewards": rewards}
        paths.write_text_atomic(base + ".jsonl", _jsonl([meta] + records))  # last: the shard is finished
        if progress:
            log(f"shard {s + 1}/{num_shards}: {len(part)} questions, {len(records)} steps, "
                f"{time.perf_counter() - t0:.1f} s")
    return _finish(out, key, num_shards, time.perf_counter() - t0)


def _finish(out: str, key: dict, num_shards: int, seconds: float) -> dict:
    records, embs, rewards = [], [], []
    for s in range(num_shards):
        base = paths.join(out, SHARDS, shard_name(s))
        rows = _read_jsonl(base + ".jsonl")
        rewards += rows[0]["rewards"]
        records += rows[1:]
        embs.append(_read_npy(base + ".npy"))
    emb = np.concatenate(embs) if embs else np.zeros((0, key["encoder"]["dim"]), np.float32)
    if emb.shape[0] != len(records):
        raise TraceBufferError(f"{out}/{SHARDS}: {len(records)} steps but {emb.shape[0]} embeddings")
    kept = {(r["qid"], r["sample"]): r["reward"] for r in records}
    sampled = np.asarray([x for rs in rewards for x in rs], np.float64)
    counts = {"questions": key["questions"], "trajectories_sampled": int(sampled.size),
              "trajectories_kept": len(kept), "steps": len(records),
              "insertable_steps": sum(r["insertable"] for r in records),
              "answer_steps": sum(r["kind"] == "answer" for r in records),
              "invalid_steps": sum(r["kind"] == "invalid" for r in records),
              "distinct_steps": len({(r["key"], r["value"]) for r in records}),
              "questions_with_success": int(sum(max(rs, default=0.0) >= 1.0 for rs in rewards))}
    kept_r = np.asarray(list(kept.values()), np.float64)
    manifest = {k: key[k] for k in ("format", "encoder", "world", "policy", "n", "k", "tie_break", "min_reward",
                                    "history_chars", "seed", "shard_size", "structure_format_score")}
    manifest.update(kind="rexrag_trace_buffer", count=len(records), counts=counts,
                    rewards={"sampled_mean": float(sampled.mean()) if sampled.size else 0.0,
                             "kept_mean": float(kept_r.mean()) if kept_r.size else 0.0,
                             "kept_below_1": int((kept_r < 1.0).sum())},
                    build_seconds=round(seconds, 3), created_unix=int(time.time()))
    paths.write_text_atomic(paths.join(out, STEPS), _jsonl(records))
    _write_bytes_atomic(paths.join(out, EMB), _npy_bytes(emb))
    paths.write_json_atomic(paths.join(out, MANIFEST), manifest, indent=2, sort_keys=True)  # last: finished
    paths.remove_tree(paths.join(out, SHARDS))
    if paths.isfile(paths.join(out, STATE)):
        paths.as_path(paths.join(out, STATE)).unlink()
    return manifest


# --- loading --------------------------------------------------------------------------------------------
def read_manifest(buffer_dir: str) -> dict:
    """The manifest of a finished buffer, required fields checked (TraceBufferError otherwise)."""
    buffer_dir = paths.as_str(buffer_dir).rstrip("/")
    mpath = paths.join(buffer_dir, MANIFEST)
    if not paths.isfile(mpath):
        hint = " (a build was interrupted: rerun build-trace-buffer to resume it)" \
            if paths.isfile(paths.join(buffer_dir, STATE)) else ""
        raise TraceBufferError(f"{buffer_dir}: not a finished trace buffer, {MANIFEST} missing{hint}")
    try:
        m = paths.read_json(mpath)
    except (OSError, json.JSONDecodeError) as e:
        raise TraceBufferError(f"{mpath}: unreadable ({e})") from None
    for field in ("format", "encoder", "world", "count", "counts", "n", "k"):
        if field not in m:
            raise TraceBufferError(f"{mpath}: field {field!r} missing")
    if m["format"] != FORMAT_VERSION:
        raise TraceBufferError(f"{mpath}: format {m['format']} not supported (expected {FORMAT_VERSION})")
    return m


def load_static_buffer(buffer_dir: str, encode_fn, *, world_id: str | None = None, extra_capacity: int = 0,
                       searcher: str = "exact", encoder_name: str | None = None) -> tuple[TraceBuffer, dict]:
    """(TraceBuffer holding the static buffer's steps, manifest). Checked: the manifest, the encoder
    (name, dim, and max_length where both sides know it), the world id (when given), a non-empty buffer
    with at least one insertable step, and the files' counts. capacity = count + extra_capacity (room for
    online filling on top: FIFO then evicts the oldest, static, entries first)."""
    buffer_dir = paths.as_str(buffer_dir).rstrip("/")
    m = read_manifest(buffer_dir)
    mpath = paths.join(buffer_dir, MANIFEST)
    name = encoder_name or getattr(encode_fn, "encoder_name", "custom")
    got = dict(encoder_description(encode_fn), name=name)
    want = m["encoder"]
    diff = [f"{f} {want.get(f)!r} (buffer) vs {got[f]!r} (trainer)" for f in ("name", "dim", "max_length")
            if want.get(f) != got[f] and not (f == "max_length" and None in (want.get(f), got[f]))]
    if diff:
        raise TraceBufferError(f"{mpath}: built with another encoder: {'; '.join(diff)}")
    if world_id is not None and m["world"].get("id") != world_id:
        raise TraceBufferError(f"{mpath}: built for another world: questions fingerprint {str(m['world'].get('id'))[:12]}… "
                               f"({m['world'].get('questions', '?')}), the training questions have {world_id[:12]}…")
    if not m["count"]:
        raise TraceBufferError(f"{mpath}: the trace buffer is empty (count 0; the stronger policy kept no step)")
    if not m["counts"].get("insertable_steps", 0):
        raise TraceBufferError(f"{mpath}: the trace buffer has {m['count']} steps but none insertable (a search "
                               "step with its observation); hybrid rollouts could never insert")
    rows = _read_jsonl(paths.join(buffer_dir, STEPS))
    emb = _read_npy(paths.join(buffer_dir, EMB)).astype(np.float32)
    if len(rows) != m["count"] or emb.shape != (m["count"], want["dim"]):
        raise TraceBufferError(f"{buffer_dir}: {len(rows)} steps and embeddings {emb.shape}; the manifest says "
                               f"{m['count']} x {want['dim']}")
    buf = TraceBuffer(encode_fn, capacity=len(rows) + max(0, int(extra_capacity)), searcher=searcher,
                      encoder_name=name)
    buf.keys, buf.values, buf.emb = [r["key"] for r in rows], [r["value"] for r in rows], emb
    buf.total_added = len(rows)
    return buf, m
