"""HF checkpoint load/export against transformers Qwen2ForCausalLM (tiny random models)."""
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qwen2_hf_fixtures import batch, hf_logits, make_hf_model
from rexrag_jax.models.qwen2 import hf_io
from rexrag_jax.models.qwen2.model import forward, init_cache
from rexrag_jax.sharding import make_mesh


def _ours(params, cfg, tokens, mask):
    return np.asarray(jax.jit(lambda p, t, m: forward(p, t, cfg, attention_mask=m)[0])(params, tokens, mask))


def _max_diff_on_real(a, b, mask):
    return float(np.max(np.abs(a - b) * mask[..., None]))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_ckpts")
    out = {}
    for variant in ("tied_gqa4", "untied_mha"):
        model = make_hf_model(variant)
        model.save_pretrained(root / variant)
        out[variant] = (model, str(root / variant))
    model = out["tied_gqa4"][0]
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    out["sharded"] = (model, str(root / "sharded"))
    bf16 = make_hf_model("untied_mha", seed=3).to(torch.bfloat16)
    bf16.save_pretrained(root / "bf16")
    out["bf16"] = (bf16, str(root / "bf16"))
    return out


@pytest.fixture(scope="module")
def loaded(ckpts):
    return {k: hf_io.load_checkpoint(ckpts[k][1], progress=False) for k in ("tied_gqa4", "untied_mha", "sharded")}


@pytest.mark.parametrize("variant", ["tied_gqa4", "untied_mha", "sharded"])
def test_fp32_logits_match_transformers(ckpts, loaded, variant):
    model, path = ckpts[variant]
    cfg, params = loaded[variant]
    assert cfg.tie_word_embeddings == (variant != "untied_mha")
    assert ("lm_head" in params) == (variant == "untied_mha")
    assert cfg.rope_theta == 5000.0 and cfg.rms_norm_eps == 1e-5
    tokens, mask = batch()
    ref = hf_logits(model, tokens, mask)
    got = _ours(params, cfg, tokens, mask)
    assert _max_diff_on_real(got, ref, mask) <= 1e-4
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits


def test_sharded_checkpoint_really_is_sharded_and_loads_identically(ckpts, loaded):
    files = [f for f in os.listdir(ckpts["sharded"][1]) if f.endswith(".safetensors")]
    assert len(files) > 1 and os.path.exists(os.path.join(ckpts["sharded"][1], "model.safetensors.index.json"))
    for a, b in zip(jax.tree_util.tree_leaves(loaded["sharded"][1]), jax.tree_util.tree_leaves(loaded["tied_gqa4"][1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cached_prefill_then_decode_matches_transformers(ckpts, loaded):
    model, _ = ckpts["untied_mha"]
    cfg, params = loaded["untied_mha"]
    tokens, _ = batch(seed=5, B=2, T=10)
    ref = hf_logits(model, tokens, np.ones_like(tokens))
    cache = init_cache(cfg, 2, 16)
    step = jax.jit(lambda p, t, c: forward(p, t, cfg, cache=c))
    first, cache = step(params, tokens[:, :7], cache)
    mid, cache = step(params, tokens[:, 7:8], cache)
    last, cache = step(params, tokens[:, 8:], cache)
    got = np.concatenate([np.asarray(first), np.asarray(mid), np.asarray(last)], axis=1)
    assert np.abs(got - ref).max() <= 1e-4
    assert list(np.asarray(cache["lengths"])) == [10, 10]


def test_load_into_mesh_shards_params_and_keeps_values(ckpts, loaded):
    mesh = make_mesh(2, 2, 2)
    cfg, params = hf_io.load_checkpoint(ckpts["untied_mha"][1], mesh=mesh, progress=False)
    q = params["layers"]["q_kernel"]  # [L, D, H, Hd] -> (None, fsdp, tensor, None)
    assert tuple(q.sharding.spec) == (None, "fsdp", "tensor", None)
    assert {s.data.shape for s in q.addressable_shards} == {(2, 16, 2, 8)}
    assert tuple(params["lm_head"].sharding.spec) == ("fsdp", "tensor")
    ref = loaded["untied_mha"][1]
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mesh_load_materialises_only_device_slices(ckpts, monkeypatch):
    """Every host buffer handed to JAX is one device's shard, never the whole (unsharded) leaf."""
    sizes = {}
    real = jax.make_array_from_callback

    def spy(shape, sharding, cb, dtype=None):
        def wrapped(index):
            out = cb(index)
            sizes.setdefault(tuple(shape), set()).add(out.size)
            return out
        return real(shape, sharding, wrapped, dtype=dtype)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    cfg, params = hf_io.load_checkpoint(ckpts["untied_mha"][1], mesh=make_mesh(1, 4, 2), progress=False)
    for leaf in (params["layers"]["q_kernel"], params["layers"]["gate_kernel"], params["lm_head"], params["embed"]):
        assert sizes[leaf.shape] == {leaf.size // 8}, leaf.shape


def test_reader_reads_only_the_device_slice(ckpts):
    """Each callback gets its device's index and returns exactly that slice (no full leaf per device)."""
    cfg = hf_io.load_config(ckpts["untied_mha"][1])
    st = hf_io.SafetensorsDir(ckpts["untied_mha"][1])
    read = hf_io._leaf_reader(st, "layers.gate_kernel", cfg, np.dtype(np.float32))
    full = np.stack([load_file(os.path.join(ckpts["untied_mha"][1], "model.safetensors"))
                     [f"model.layers.{i}.mlp.gate_proj.weight"].numpy().T for i in range(2)])
    part = read((slice(1, 2), slice(8, 16), slice(24, 48)))
    assert part.shape == (1, 8, 24)
    np.testing.assert_array_equal(part, full[1:2, 8:16, 24:48])


def test_bf16_checkpoint_bytes_are_read_exactly(ckpts):
    model, path = ckpts["bf16"]
    assert json.load(open(os.path.join(path, "config.json")))["dtype"] == "bfloat16"
    cfg, params = hf_io.load_checkpoint(path, param_dtype="float32", progress=False)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(np.asarray(params["layers"]["o_kernel"][1]),
                                  sd["model.layers.1.self_attn.o_proj.weight"].reshape(32, 4, 8).transpose(1, 2, 0))
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), sd["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["layers"]["k_bias"][0]),
                                  sd["model.layers.0.self_attn.k_proj.bias"].reshape(4, 8))


def test_bf16_params_run_and_stay_close(ckpts, loaded):
    model, path = ckpts["untied_mha"]
    cfg, params = hf_io.load_checkpoint(path, param_dtype="bfloat16", progress=False)
    assert cfg.param_dtype == cfg.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    tokens, mask = batch()
    ref = hf_logits(model, tokens, mask)
    got = _ours(params, cfg, tokens, mask)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    err = _max_diff_on_real(got, ref, mask)
    assert err <= 0.05 * np.abs(ref).max(), err
    assert err > 0  # it really ran in bf16


@pytest.mark.parametrize("variant", ["tied_gqa4", "untied_mha"])
def test_export_reloads_in_transformers_with_identical_logits(ckpts, loaded, tmp_path, variant):
    model, src = ckpts[variant]
    cfg, params = loaded[variant]
    out = hf_io.export_checkpoint(params, cfg, str(tmp_path / "export"), copy_files_from=src, progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.rope_parameters["rope_theta"] == 5000.0
    assert reloaded.config.tie_word_embeddings == cfg.tie_word_embeddings
    tokens, mask = batch(seed=7)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens, mask), hf_logits(model, tokens, mask))
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert ("lm_head.weight" in saved) == (variant == "untied_mha")
    for k, v in model.state_dict().items():
        if k in saved:
            assert torch.equal(saved[k], v), k


def test_export_sharded_by_size_roundtrips(loaded, tmp_path):
    cfg, params = loaded["untied_mha"]
    out = hf_io.export_checkpoint(params, cfg, str(tmp_path / "ex"), max_shard_size="16KB", progress=False)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == files
    for f in files:  # no shard exceeds the limit unless it holds a single larger tensor
        n = len(load_file(os.path.join(out, f)))
        assert os.path.getsize(os.path.join(out, f)) <= 16_000 + 4096 or n == 1
    assert index["metadata"]["total_size"] == sum(x.size * 4 for x in jax.tree_util.tree_leaves(params))
    cfg2, params2 = hf_io.load_checkpoint(out, progress=False)
    assert cfg2 == cfg
    for a, b in zip(jax.tree_util.tree_leaves(params2), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_bf16_dtype(loaded, tmp_path):
    cfg, params = loaded["tied_gqa4"]
    out = hf_io.export_checkpoint(params, cfg, str(tmp_path / "bf"), dtype="bfloat16", progress=False)
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert saved["model.embed_tokens.weight"].dtype == torch.bfloat16
    np.testing.assert_array_equal(saved["model.embed_tokens.weight"].float().numpy(),
                                  np.asarray(params["embed"]).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"


def test_failed_export_leaves_old_export_and_no_temp(loaded, tmp_path, monkeypatch):
    cfg, params = loaded["untied_mha"]
    target = tmp_path / "good"
    hf_io.export_checkpoint(params, cfg, str(target), max_shard_size="16KB", progress=False)
    before = {f: (target / f).read_bytes() for f in os.listdir(target)}
    with pytest.raises(FileExistsError, match="overwrite"):
        hf_io.export_checkpoint(params, cfg, str(target), progress=False)

    calls = []
    real = hf_io._write_safetensors_file

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(*a, **kw)

    monkeypatch.setattr(hf_io, "_write_safetensors_file", failing)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    with pytest.raises(OSError, match="simulated"):
        hf_io.export_checkpoint(zeros, cfg, str(target), max_shard_size="16KB", overwrite=True, progress=False)
    assert len(calls) == 2
    assert sorted(os.listdir(tmp_path)) == ["good"]  # no temp / backup dirs left behind
    assert {f: (target / f).read_bytes() for f in os.listdir(target)} == before

    monkeypatch.setattr(hf_io, "_write_safetensors_file", real)
    hf_io.export_checkpoint(zeros, cfg, str(target), overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["good"]
    assert not np.asarray(hf_io.load_checkpoint(str(target), progress=False)[1]["embed"]).any()


# --- bad input -----------------------------------------------------------------------------------
def _copy_ckpt(src, dst, edit_tensors=None, edit_config=None):
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    if edit_config:
        edit_config(cfg)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def test_missing_tensor_is_named(ckpts, tmp_path):
    path = _copy_ckpt(ckpts["untied_mha"][1], tmp_path / "c",
                      lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                         r"\(expected shape \(48, 32\)\)"):
        hf_io.load_checkpoint(path, progress=False)


def test_untied_without_lm_head_is_an_error(ckpts, tmp_path):
    path = _copy_ckpt(ckpts["untied_mha"][1], tmp_path / "c", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        hf_io.load_checkpoint(path, progress=False)


def test_wrong_shape_names_tensor_and_shapes(ckpts, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
    path = _copy_ckpt(ckpts["untied_mha"][1], tmp_path / "c", edit)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 32\), "
                                         r"expected \(32, 32\)"):
        hf_io.load_checkpoint(path, progress=False)


def test_tied_config_with_different_lm_head_is_an_error(ckpts, tmp_path):
    def edit(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone() + 1.0
    path = _copy_ckpt(ckpts["tied_gqa4"][1], tmp_path / "c", edit)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_io.load_checkpoint(path, progress=False)
    # ...while an equal copy of the embedding is accepted.
    path = _copy_ckpt(ckpts["tied_gqa4"][1], tmp_path / "d",
                      lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    assert "lm_head" not in hf_io.load_checkpoint(path, progress=False)[1]


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "llama", r"unsupported architecture \(model_type='llama'"),
    ("hidden_act", "gelu", r"unsupported hidden_act='gelu'"),
    ("use_sliding_window", True, r"unsupported use_sliding_window"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, r"rope_parameters\.rope_type='yarn'"),
])
def test_unsupported_config_names_the_field(ckpts, tmp_path, field, value, match):
    path = _copy_ckpt(ckpts["tied_gqa4"][1], tmp_path / "c", edit_config=lambda c: c.__setitem__(field, value))
    with pytest.raises(ValueError, match=match) as e:
        hf_io.load_checkpoint(path, progress=False)
    assert "config.json" in str(e.value)


def test_missing_config_json(ckpts, tmp_path):
    path = _copy_ckpt(ckpts["tied_gqa4"][1], tmp_path / "c")
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match=r"config\.json: missing"):
        hf_io.load_checkpoint(path, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_io.load_checkpoint(str(tmp_path / "nowhere"), progress=False)


def test_layout_table_inverts(ckpts):
    """to_hf(to_ours(x)) == x for every table entry (export is the exact inverse of load)."""
    cfg = hf_io.load_config(ckpts["untied_mha"][1])
    sizes = hf_io._sizes(cfg)
    rng = np.random.default_rng(0)
    for path, layout in hf_io.LAYOUTS.items():
        x = rng.normal(size=layout.hf_shape(sizes)).astype(np.float32)
        np.testing.assert_array_equal(layout.to_hf(layout.to_ours(x, sizes), sizes), x)


def test_load_params_rejects_a_config_that_disagrees_with_config_json(ckpts):
    cfg = hf_io.load_config(ckpts["tied_gqa4"][1])
    with pytest.raises(ValueError, match=r"rope_theta: config 10000\.0 vs checkpoint 5000\.0"):
        hf_io.load_params(ckpts["tied_gqa4"][1], cfg.replace(rope_theta=10000.0), progress=False)
    params = hf_io.load_params(ckpts["tied_gqa4"][1], cfg.replace(remat=True, dtype="bfloat16"), progress=False)
    assert params["embed"].shape == (96, 32)


def test_iter_hf_tensors_yields_the_transformers_state_dict(ckpts, loaded):
    model, _ = ckpts["untied_mha"]
    cfg, params = loaded["untied_mha"]
    got = dict(hf_io.iter_hf_tensors(params, cfg))
    ref = {k: v.numpy() for k, v in model.state_dict().items()}
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
