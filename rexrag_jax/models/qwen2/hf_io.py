"""Hugging Face Qwen2 checkpoints <-> our params pytree, straight into (or out of) sharded arrays.

One declarative table, `KEY_MAP`, says where every leaf lives in a HF checkpoint and how its layout
differs, in einops-like notation: `"(H Hd) D" -> "D H Hd"` means the HF tensor has shape [H*Hd, D] and
ours is its [H, Hd, D] view transposed to [D, H, Hd]. Both directions (load and export) are derived from
that table alone.

Loading never builds an unsharded copy of the model in host memory: each safetensors file is memory-
mapped (the header is parsed here; numpy's safetensors backend cannot produce bfloat16), each leaf is
created with `jax.make_array_from_callback` against its target sharding, and the callback reads only
the slice its device needs, from the transformed *view* of the mapped tensor, so only the touched pages
are read. Stacked layer leaves [L, ...] gather layer i from `model.layers.{i}.*`.

Export writes safetensors shards (split by size, with `model.safetensors.index.json`), `config.json`
and `generation_config.json` into a temporary sibling directory that is renamed into place at the end:
a failed export leaves nothing behind and never touches an existing export.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding
from tqdm import tqdm

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import param_shapes

log = logging.getLogger(__name__)

# our path -> (HF key, {i} = layer index; HF layout; our layout without the stacked "L" axis)
KEY_MAP: dict[str, tuple[str, str, str]] = {
    "embed": ("model.embed_tokens.weight", "V D", "V D"),
    "layers.attn_norm": ("model.layers.{i}.input_layernorm.weight", "D", "D"),
    "layers.q_kernel": ("model.layers.{i}.self_attn.q_proj.weight", "(H Hd) D", "D H Hd"),
    "layers.q_bias": ("model.layers.{i}.self_attn.q_proj.bias", "(H Hd)", "H Hd"),
    "layers.k_kernel": ("model.layers.{i}.self_attn.k_proj.weight", "(KV Hd) D", "D KV Hd"),
    "layers.k_bias": ("model.layers.{i}.self_attn.k_proj.bias", "(KV Hd)", "KV Hd"),
    "layers.v_kernel": ("model.layers.{i}.self_attn.v_proj.weight", "(KV Hd) D", "D KV Hd"),
    "layers.v_bias": ("model.layers.{i}.self_attn.v_proj.bias", "(KV Hd)", "KV Hd"),
    "layers.o_kernel": ("model.layers.{i}.self_attn.o_proj.weight", "D (H Hd)", "H Hd D"),
    "layers.mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", "D", "D"),
    "layers.gate_kernel": ("model.layers.{i}.mlp.gate_proj.weight", "F D", "D F"),
    "layers.up_kernel": ("model.layers.{i}.mlp.up_proj.weight", "F D", "D F"),
    "layers.down_kernel": ("model.layers.{i}.mlp.down_proj.weight", "D F", "F D"),
    "final_norm": ("model.norm.weight", "D", "D"),
    "lm_head": ("lm_head.weight", "V D", "D V"),
}
# Buffers some exporters write that carry no weights.
_IGNORED_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
              "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


# --- the layout algebra ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """HF layout "(H Hd) D" -> ours "D H Hd": `atoms` = HF dims split into named atoms, `perm` = the
    transpose from the atom order to ours, `hf_groups` = atom groups per HF dim."""
    hf_groups: tuple[tuple[str, ...], ...]
    atoms: tuple[str, ...]
    perm: tuple[int, ...]

    @classmethod
    def parse(cls, hf: str, ours: str) -> "Layout":
        groups = tuple(tuple((grouped or single).split())
                       for grouped, single in re.findall(r"\(([^)]*)\)|(\S+)", hf))
        atoms = tuple(a for g in groups for a in g)
        mine = tuple(ours.split())
        if sorted(atoms) != sorted(mine):
            raise ValueError(f"layout {hf!r} -> {ours!r}: the two sides name different dims")
        return cls(groups, atoms, tuple(atoms.index(a) for a in mine))

    def hf_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(math.prod(sizes[a] for a in g) for g in self.hf_groups)

    def to_ours(self, hf_array: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        """A (lazy, strided) view of the HF tensor in our layout; nothing is copied."""
        return hf_array.reshape([sizes[a] for a in self.atoms]).transpose(self.perm)

    def to_hf(self, ours: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        return np.ascontiguousarray(ours.transpose(np.argsort(self.perm))).reshape(self.hf_shape(sizes))


LAYOUTS = {path: Layout.parse(hf_layout, ours) for path, (_, hf_layout, ours) in KEY_MAP.items()}


def _sizes(cfg: Qwen2Config) -> dict[str, int]:
    return {"V": cfg.vocab_size, "D": cfg.hidden_size, "F": cfg.intermediate_size, "H": cfg.num_heads,
            "KV": cfg.num_kv_heads, "Hd": cfg.head_dim}


def _leaf_paths(cfg: Qwen2Config) -> list[str]:
    """Dotted paths of the leaves of init_params(cfg), e.g. "embed", "layers.q_kernel"."""
    out = []
    for k, v in param_shapes(cfg).items():
        out += [f"{k}.{leaf}" for leaf in v] if isinstance(v, dict) else [k]
    return out


def hf_keys(path: str, cfg: Qwen2Config) -> list[str]:
    """HF tensor names behind one of our leaves (one per layer for stacked leaves)."""
    pattern = KEY_MAP[path][0]
    return [pattern.format(i=i) for i in range(cfg.num_layers)] if "{i}" in pattern else [pattern]


# --- reading --------------------------------------------------------------------------------------
class SafetensorsDir:
    """All tensors of a checkpoint directory as lazy numpy memmaps (any dtype, incl. bfloat16)."""

    def __init__(self, ckpt_dir: str):
        self.dir = ckpt_dir
        index = os.path.join(ckpt_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e}); expected a 'weight_map' "
                                 "object") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"{ckpt_dir}: no *.safetensors files (and no model.safetensors.index.json)")
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for name in files:
            path = os.path.join(ckpt_dir, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{index}: lists shard {name!r}, which is missing from {ckpt_dir}")
            for key, (dtype, shape, start, end) in _read_header(path).items():
                if weight_map is None or weight_map.get(key) == name:
                    self.entries[key] = (path, dtype, shape, start, end)
        self._maps: dict[str, np.memmap] = {}

    def close(self) -> None:
        self._maps.clear()

    def shape(self, key: str) -> tuple[int, ...] | None:
        e = self.entries.get(key)
        return None if e is None else e[2]

    def array(self, key: str) -> np.ndarray:
        """Lazy view of one tensor (pages are read when sliced)."""
        path, dtype, shape, start, end = self.entries[key]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {dtype}; expected one of {sorted(_ST_DTYPES)}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path][start:end].view(_ST_DTYPES[dtype]).reshape(shape)


def _read_header(path: str) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """safetensors layout: u64 little-endian header size N, N bytes of JSON, then the data buffer."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: truncated safetensors file (no header)")
        n = int.from_bytes(raw, "little")
        if n > 100 * 2**20 or n > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: header size {n} is not plausible; not a safetensors file?")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from e
    base = 8 + n
    return {k: (v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def load_config(ckpt_dir: str, **overrides) -> Qwen2Config:
    """Qwen2Config from `ckpt_dir/config.json` (unsupported architectures / features raise, naming the field)."""
    path = os.path.join(ckpt_dir, "config.json")
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: checkpoint directory does not exist")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: missing; a HF checkpoint directory needs config.json next to "
                                "its *.safetensors files")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from e
    return Qwen2Config.from_hf_dict(d, source=path, **overrides)


# Fields that change the function the weights compute (dtype / remat / max length do not).
_ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings")


def _check_config_matches(ckpt_dir: str, cfg: Qwen2Config) -> None:
    """A cfg chosen elsewhere (gin preset) must agree with the checkpoint's own config.json."""
    if not os.path.exists(os.path.join(ckpt_dir, "config.json")):
        return
    ref = load_config(ckpt_dir)
    diff = [f"{f}: config {getattr(cfg, f)!r} vs checkpoint {getattr(ref, f)!r}"
            for f in _ARCH_FIELDS if getattr(cfg, f) != getattr(ref, f)]
    if diff:
        raise ValueError(f"{os.path.join(ckpt_dir, 'config.json')}: does not match the model config: "
                         + "; ".join(diff))


def check_checkpoint(st: SafetensorsDir, cfg: Qwen2Config) -> None:
    """Raise one error listing every missing / mis-shaped tensor; warn about unused ones."""
    sizes, problems, used = _sizes(cfg), [], set()
    for path in _leaf_paths(cfg):
        want = LAYOUTS[path].hf_shape(sizes)
        for key in hf_keys(path, cfg):
            used.add(key)
            got = st.shape(key)
            if got is None:
                problems.append(f"missing tensor {key!r} (expected shape {want})")
            elif tuple(got) != want:
                problems.append(f"tensor {key!r} has shape {tuple(got)}, expected {want} "
                                f"(HF layout {KEY_MAP[path][1]!r} with {_dims_str(KEY_MAP[path][1], sizes)})")
    if cfg.tie_word_embeddings and "lm_head.weight" in st.entries:
        used.add("lm_head.weight")
        if not problems:
            _check_tied(st)
    if problems:
        more = f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(f"{st.dir}: checkpoint does not match config.json: " + "; ".join(problems[:10]) + more)
    unused = sorted(k for k in st.entries if k not in used and not _IGNORED_KEYS.fullmatch(k))
    if unused:
        log.warning("%s: %d tensors not used by Qwen2ForCausalLM, e.g. %s", st.dir, len(unused), unused[:5])


def _dims_str(layout: str, sizes: dict[str, int]) -> str:
    return " ".join(f"{a}={sizes[a]}" for a in dict.fromkeys(re.findall(r"[A-Za-z]+", layout)))


def _check_tied(st: SafetensorsDir, rows: int = 8192) -> None:
    """tie_word_embeddings with an lm_head.weight present: it must equal the embedding (row chunks)."""
    emb, head = st.array("model.embed_tokens.weight"), st.array("lm_head.weight")
    if emb.shape != head.shape:
        raise ValueError(f"{st.dir}: tie_word_embeddings=true but lm_head.weight has shape {head.shape} "
                         f"and model.embed_tokens.weight {emb.shape}")
    for s in range(0, emb.shape[0], rows):
        if not np.array_equal(np.asarray(emb[s:s + rows], np.float32), np.asarray(head[s:s + rows], np.float32)):
            raise ValueError(f"{st.dir}: config.json has tie_word_embeddings=true but lm_head.weight differs "
                             f"from model.embed_tokens.weight (first differing rows from {s}); set "
                             "tie_word_embeddings=false to load an untied head")


def _leaf_reader(st: SafetensorsDir, path: str, cfg: Qwen2Config, dtype: np.dtype) -> Callable:
    """index (tuple of slices into our leaf) -> numpy slice; reads only the requested region."""
    sizes, layout, keys = _sizes(cfg), LAYOUTS[path], hf_keys(path, cfg)
    stacked = "{i}" in KEY_MAP[path][0]
    cache: dict[Any, np.ndarray] = {}  # replicated leaves are requested once per device

    def read(index) -> np.ndarray:
        index = tuple(index) if index is not None else ()
        ck = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)
        if ck not in cache:
            if stacked:
                layer_idx, rest = (index[0], index[1:]) if index else (slice(None), ())
                parts = [np.asarray(layout.to_ours(st.array(keys[i]), sizes)[rest]).astype(dtype)
                         for i in range(cfg.num_layers)[layer_idx]]
                cache[ck] = np.stack(parts)
            else:
                cache[ck] = np.asarray(layout.to_ours(st.array(keys[0]), sizes)[index]).astype(dtype)
        return cache[ck]

    return read


def load_params(ckpt_dir: str, cfg: Qwen2Config, shardings=None, *, param_dtype: str | None = None,
                progress: bool = True):
    """Params pytree for `cfg` read from `ckpt_dir`, each leaf created directly with its sharding.

    shardings: pytree of jax Shardings matching init_params(cfg) (e.g. sharding.param_shardings(cfg,
    mesh)); default: everything on jax.devices()[0]. param_dtype defaults to cfg.param_dtype.
    """
    _check_config_matches(ckpt_dir, cfg)
    st = SafetensorsDir(ckpt_dir)
    check_checkpoint(st, cfg)
    dtype = np.dtype(ml_dtypes.bfloat16) if (param_dtype or cfg.param_dtype) == "bfloat16" else \
        np.dtype(param_dtype or cfg.param_dtype)
    shapes = param_shapes(cfg)
    single = SingleDeviceSharding(jax.devices()[0])
    params: dict[str, Any] = {}
    for path in tqdm(_leaf_paths(cfg), desc=f"load {os.path.basename(os.path.normpath(ckpt_dir))}",
                     disable=not progress, leave=False):
        node, shape_node, shard_node = params, shapes, shardings
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            shape_node = shape_node[p]
            shard_node = None if shard_node is None else shard_node[p]
        sharding = single if shard_node is None else shard_node[leaf]
        if not isinstance(sharding, Sharding):
            raise TypeError(f"shardings[{path!r}] is {type(sharding).__name__}, expected a jax Sharding")
        node[leaf] = jax.make_array_from_callback(shape_node[leaf], sharding,
                                                  _leaf_reader(st, path, cfg, dtype), dtype=dtype)
        st.close()  # unmap: the pages this leaf touched leave our RSS before the next leaf is read
    return params


def load_checkpoint(ckpt_dir: str, mesh=None, *, param_dtype: str = "float32", dtype: str | None = None,
                    progress: bool = True, **overrides):
    """(cfg, params) from a HF Qwen2 directory; with `mesh`, params are sharded by the logical rules.

    param_dtype: storage dtype of the loaded params ("float32" | "bfloat16"); dtype: compute dtype
    (defaults to param_dtype). Other keyword arguments override Qwen2Config fields (e.g. remat=True).
    """
    cfg = load_config(ckpt_dir, param_dtype=param_dtype, dtype=dtype or param_dtype, **overrides)
    shardings = None
    if mesh is not None:
        from rexrag_jax.sharding.partition import param_shardings
        shardings = param_shardings(cfg, mesh)
    return cfg, load_params(ckpt_dir, cfg, shardings, progress=progress)


# --- export ---------------------------------------------------------------------------------------
def _parse_size(size: int | str) -> int:
    """5_000_000_000 | "5GB" (10^9) | "4GiB" (2^30) | "500MB" | "20KB" -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or e.g. '5GB', '500MB', '4GiB'")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(unit[0] if unit[0] in "KMGT" else " "))


@functools.partial(jax.jit, static_argnames=("perm", "dtype"))
def _to_hf_order(a: jax.Array, i: jax.Array | None, perm: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    """Layer i (if given) of leaf `a`, transposed to the HF atom order and cast, on device: one compile
    per leaf (a static a[i] would compile once per layer) and XLA's transpose instead of numpy's."""
    x = a if i is None else jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False)
    return jnp.transpose(x, np.argsort(perm)).astype(dtype)


def _host(x) -> np.ndarray:
    """Gather a (possibly multi-host) array to a numpy array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _hf_tensors(params, cfg: Qwen2Config, dtype: np.dtype) -> list[tuple[str, tuple[int, ...], Callable]]:
    """(HF key, HF shape, fetch -> numpy in HF layout) in checkpoint order, one layer slice at a time."""
    sizes, out = _sizes(cfg), []
    expected = param_shapes(cfg)
    for path in _leaf_paths(cfg):
        *parents, leaf = path.split(".")
        node, shape_node = params, expected
        for p in parents:
            node, shape_node = node[p], shape_node[p]
        if leaf not in node:
            raise KeyError(f"export: params has no leaf {path!r} (tie_word_embeddings="
                           f"{cfg.tie_word_embeddings})")
        arr = node[leaf]
        if tuple(arr.shape) != tuple(shape_node[leaf]):
            raise ValueError(f"export: params[{path!r}] has shape {tuple(arr.shape)}, expected "
                             f"{tuple(shape_node[leaf])} for this config")
        layout, hf_shape = LAYOUTS[path], LAYOUTS[path].hf_shape(sizes)
        stacked = "{i}" in KEY_MAP[path][0]
        for i, key in enumerate(hf_keys(path, cfg)):
            fetch = (lambda a=arr, i=(np.int32(i) if stacked else None), perm=layout.perm, shape=hf_shape:
                     np.ascontiguousarray(_host(_to_hf_order(a, i, perm, dtype))).reshape(shape))
            out.append((key, hf_shape, fetch))
    return out


def _plan_shards(tensors, itemsize: int, max_bytes: int) -> list[list]:
    shards, cur, cur_bytes = [], [], 0
    for t in tensors:
        nbytes = math.prod(t[1]) * itemsize
        if cur and cur_bytes + nbytes > max_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(t)
        cur_bytes += nbytes
    return shards + ([cur] if cur else [])


def _write_safetensors_file(path: str, tensors, dtype: np.dtype, bar) -> int:
    """Stream tensors into one safetensors file: the header is known from shapes, data one tensor at a
    time (host memory = the largest single tensor). Returns bytes of tensor data written."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, _ in tensors:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data buffer 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for key, shape, fetch in tensors:
            arr = fetch()
            if arr.shape != tuple(shape) or arr.dtype != dtype:
                raise AssertionError(f"export: {key} came out {arr.shape} {arr.dtype}, expected {shape} {dtype}")
            f.write(np.ascontiguousarray(arr).tobytes())
            bar.update(1)
        f.flush()
        os.fsync(f.fileno())
    return offset


def export_checkpoint(params, cfg: Qwen2Config, out_dir: str, *, dtype: str | None = None,
                      max_shard_size: int | str = "5GB", generation_config: dict | None = None,
                      copy_files_from: str | None = None, overwrite: bool = False, progress: bool = True) -> str:
    """Write a HF Qwen2ForCausalLM directory loadable by `transformers.from_pretrained`.

    dtype: tensor dtype on disk (default cfg.param_dtype). Shards hold at most max_shard_size bytes
    (a larger single tensor gets its own shard); one shard = `model.safetensors` without an index.
    copy_files_from: a source checkpoint whose tokenizer files (and generation_config.json, unless
    `generation_config` is given) are copied along. Everything is written to a temporary sibling
    directory and renamed to `out_dir` at the end; an existing `out_dir` is only replaced with
    overwrite=True, and only once the new export is complete. In multi-process runs every process must
    call this (arrays are gathered collectively); process 0 writes. Returns out_dir.
    """
    out_dir = os.path.abspath(out_dir)
    name = dtype or cfg.param_dtype
    np_dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    if np_dtype not in _ST_NAMES:
        raise ValueError(f"export dtype {name!r}: expected float32, bfloat16 or float16")
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists; pass overwrite=True to replace it")
    tensors = _hf_tensors(params, cfg, np_dtype)
    shards = _plan_shards(tensors, np_dtype.itemsize, _parse_size(max_shard_size))
    writer = jax.process_index() == 0
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent) if writer else None
    try:
        weight_map, total = {}, 0
        with tqdm(total=len(tensors), desc=f"export {os.path.basename(out_dir)}", disable=not (progress and writer),
                  leave=False) as bar:
            for k, shard in enumerate(shards):
                fname = "model.safetensors" if len(shards) == 1 else \
                    f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                if writer:
                    total += _write_safetensors_file(os.path.join(tmp, fname), shard, np_dtype, bar)
                else:  # take part in the collective gathers without writing
                    for _, _, fetch in shard:
                        fetch()
                weight_map.update({key: fname for key, _, _ in shard})
        if not writer:
            return out_dir
        if len(shards) > 1:
            _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        hf_cfg = cfg.to_hf_dict()
        hf_cfg["torch_dtype"] = hf_cfg["dtype"] = name
        _write_json(os.path.join(tmp, "config.json"), hf_cfg)
        src_gen = copy_files_from and os.path.join(copy_files_from, "generation_config.json")
        if generation_config is None and src_gen and os.path.exists(src_gen):
            shutil.copyfile(src_gen, os.path.join(tmp, "generation_config.json"))
        else:
            _write_json(os.path.join(tmp, "generation_config.json"),
                        generation_config if generation_config is not None else {"_from_model_config": True})
        for fname in _TOKENIZER_FILES if copy_files_from else ():
            src = os.path.join(copy_files_from, fname)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(tmp, fname))
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; an export is meant to be read by others
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _swap_into_place(tmp: str, out_dir: str) -> None:
    """rename(tmp -> out_dir); an existing out_dir is moved aside first and restored if that fails."""
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    os.rmdir(old)
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def iter_hf_tensors(params, cfg: Qwen2Config, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
    """(HF key, numpy tensor in HF layout), one at a time: e.g. to push weights to an inference server."""
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    for key, _, fetch in _hf_tensors(params, cfg, np_dtype):
        yield key, fetch()
