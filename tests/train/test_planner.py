"""Memory planner: parameter counts vs published sizes and the real model's arrays, shard bytes vs
hand-computed values, gin macros, CLI overrides and the fit verdict."""
import math

import jax
import numpy as np
import pytest

from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.train import planner
from rexrag_jax.train.planner import (GiB, PlanInputs, activation_bytes, kv_cache_bytes, make_plan, param_count,
                                      param_shard_elements, parse_mesh, tpu_devices)

TINY = Qwen2Config.from_preset("tiny")  # V=512 D=64 F=128 L=2 H=4 KV=2 Hd=16, tied


def test_param_count_tiny_by_hand():
    per_layer = (2 * 64            # attn_norm, mlp_norm
                 + 64 * 4 * 16 + 4 * 16          # q kernel + bias
                 + 2 * (64 * 2 * 16 + 2 * 16)    # k, v kernels + biases
                 + 4 * 16 * 64                   # o kernel
                 + 3 * 64 * 128)                 # gate, up, down
    assert per_layer == 37120
    assert param_count(TINY) == 512 * 64 + 2 * per_layer + 64 == 107072
    assert param_count(TINY.replace(tie_word_embeddings=False)) == 107072 + 64 * 512


def test_param_count_matches_model_arrays_and_tables():
    params = qwen2.init_params(TINY, jax.random.PRNGKey(0))
    assert param_count(TINY) == sum(x.size for x in jax.tree_util.tree_leaves(params))
    # The planner's leaf table is the model's: same shapes, same logical axes.
    shapes = jax.tree_util.tree_leaves(qwen2.param_shapes(TINY), is_leaf=lambda x: isinstance(x, tuple))
    ours = [s for s, _ in planner._param_tables(TINY).values()]
    assert sorted(shapes) == sorted(ours)
    axes = qwen2.param_logical_axes(TINY)
    flat = {**{k: v for k, v in axes.items() if k != "layers"}, **axes["layers"]}
    assert {k: a for k, (_, a) in planner._param_tables(TINY).items()} == flat


@pytest.mark.parametrize("preset,expected", [
    # Published Hugging Face parameter counts (embeddings included).
    ("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304),
    ("qwen2.5-3b", 3_085_938_688), ("qwen2.5-7b", 7_615_616_512)])
def test_param_count_qwen25(preset, expected):
    assert param_count(Qwen2Config.from_preset(preset)) == expected


def test_qwen25_3b_bytes_per_device_fsdp8():
    cfg = Qwen2Config.from_preset("qwen2.5-3b", param_dtype="bfloat16")
    mesh = parse_mesh("data=1,fsdp=8,tensor=1")
    # Replicated under fsdp: norms and biases (no "embed" dim); everything else splits its embed dim 8 ways.
    replicated = 36 * (2 * 2048 + 16 * 128 + 2 * 2 * 128) + 2048
    assert replicated == 241_664
    per_device = (3_085_938_688 - replicated) // 8 + replicated
    assert param_shard_elements(cfg, mesh) == per_device == 385_953_792
    plan = make_plan(PlanInputs(cfg, "qwen2.5-3b", mesh, "v5e-8", max_seq_len=4096, rollout_batch=2560,
                                mini_batch=256, micro_batch=8))
    c = plan.components
    assert c["parameters"] == 2 * per_device == 771_907_584
    assert c["adamw_moments"] == 4 * per_device and "master_copy" not in c  # m, v in bf16 like the params
    assert c["reference_policy"] == 2 * per_device and c["gradients"] == 2 * per_device
    assert c["grad_accumulator"] == 4 * per_device
    # KV cache: 2560 rows / 8 = 320 per device, 36 layers, k+v, 2 kv heads x 128, float32 compute dtype.
    assert c["kv_cache"] == 320 * 4096 * 36 * 2 * 2 * 128 * 4
    assert c["decode_logits"] == 320 * 151936 * 4
    assert plan.rollout_peak == 2 * per_device + 4 * per_device + 2 * per_device \
        + c["kv_cache"] + c["decode_logits"]
    assert plan.devices == 8 and plan.hbm_bytes == 16 * GiB and not plan.fits
    # (16 GiB - resident 8 x per_device) // (one row per device: KV 301,989,888 + logits 607,744) = 46, x 8
    assert planner.max_rollout_rows(plan) == (16 * GiB - 8 * per_device) // (301_989_888 + 607_744) * 8 == 368


def test_tensor_parallel_splits_heads_and_replicates_non_divisible():
    cfg = Qwen2Config.from_preset("qwen2.5-3b")
    # tensor=4: heads 16 split; kv_heads 2 not divisible by 4 -> replicated; vocab 151936 = 4 * 37984.
    mesh = parse_mesh("data=2,tensor=4")
    L, D, H, KV, Hd, F, V = 36, 2048, 16, 2, 128, 11008, 151936
    expect = (V // 4 * D + L * (2 * D + D * H // 4 * Hd + H // 4 * Hd + 2 * (D * KV * Hd + KV * Hd)
                                + H // 4 * Hd * D + 3 * D * F // 4) + D)
    assert param_shard_elements(cfg, mesh) == expect


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_adamw_moments_match_the_real_optimizer_state(param_dtype):
    import jax
    from rexrag_jax.models.qwen2.model import init_params
    from rexrag_jax.train.optim import OptimizerConfig

    cfg = Qwen2Config.from_preset("tiny", param_dtype=param_dtype)
    state = OptimizerConfig().make().init(init_params(cfg, jax.random.PRNGKey(0)))
    moment_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if getattr(x, "ndim", 0) > 0)
    plan = make_plan(PlanInputs(cfg, "tiny", parse_mesh("data=4"), "v4-8", max_seq_len=64, rollout_batch=4,
                                mini_batch=4, micro_batch=4))
    assert plan.components["adamw_moments"] == moment_bytes
    assert ("warning: param_dtype" in planner.format_plan(plan)) == (param_dtype != "float32")


def test_kv_cache_matches_real_cache_arrays():
    mesh = parse_mesh("data=2,fsdp=4,tensor=1")
    cache = qwen2.init_cache(TINY, batch=16, max_len=128)
    total = cache["k"].nbytes + cache["v"].nbytes
    assert kv_cache_bytes(TINY, 16, 128, mesh) == total // 8 == 2 * 128 * 2 * 2 * 2 * 16 * 4 == 131072


def test_activation_formula_by_hand():
    # tiny, float32, 3 rows x 32 tokens, no tensor split.
    per_layer = 4 * (4 * 64 + (2 * 4 + 2 * 2) * 16 + 3 * 128) + (4 + 4) * 4 * 32
    assert per_layer == 4 * (256 + 192 + 384) + 1024 == 4352
    tokens = 3 * 32
    logits = 2 * 4 * 512 * tokens
    assert activation_bytes(TINY, 3, 32) == 2 * per_layer * tokens + logits
    assert activation_bytes(TINY, 3, 32, remat=True) == (2 * 4 * 64 + per_layer) * tokens + logits
    assert activation_bytes(TINY, 3, 32, logprob_chunk=8) == 2 * per_layer * tokens + 2 * 4 * 512 * 3 * 8
    bf16 = TINY.replace(dtype="bfloat16")
    assert activation_bytes(bf16, 3, 32) < activation_bytes(TINY, 3, 32)


def test_activation_estimate_tracks_xla_memory_analysis():
    """Loose reference: XLA's own temp-buffer size for a tiny training gradient is within 2x of the
    estimate, and remat lowers both."""
    cfg = Qwen2Config.from_preset("tiny")
    rows, T = 4, 64
    params = qwen2.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.numpy.zeros((rows, T), jax.numpy.int32)

    def loss(p, c):
        return qwen2.token_logprobs(p, tokens, c).sum()

    measured = {}
    for remat in (False, True):
        c = cfg.replace(remat=remat)
        compiled = jax.jit(jax.grad(lambda p: loss(p, c))).lower(params).compile()
        stats = compiled.memory_analysis()
        if stats is None:
            pytest.fail("XLA memory_analysis() unavailable on this backend")
        measured[remat] = stats.temp_size_in_bytes
        est = activation_bytes(c, rows, T, remat=remat)
        assert 0.5 * est <= measured[remat] <= 2.0 * est, (remat, est, measured[remat])
    assert activation_bytes(cfg, rows, T, remat=True) < activation_bytes(cfg, rows, T)


@pytest.mark.parametrize("tpu,gen,devices,hbm", [("v4-8", "v4", 4, 32), ("v5e-8", "v5e", 8, 16),
                                                 ("v5litepod-16", "v5e", 16, 16), ("v5p-8", "v5p", 4, 95),
                                                 ("v6e-8", "v6e", 8, 32), ("v5p-128", "v5p", 64, 95)])
def test_tpu_table(tpu, gen, devices, hbm):
    assert tpu_devices(tpu) == (gen, devices, hbm)


@pytest.mark.parametrize("bad", ["v9-8", "v5e", "v5e-x", "tpu"])
def test_bad_tpu(bad):
    with pytest.raises(ValueError, match="--tpu"):
        tpu_devices(bad)


def test_parse_mesh():
    assert parse_mesh("fsdp=8") == {"data": 1, "fsdp": 8, "tensor": 1}
    for bad in ("fsdp=0", "pipeline=2", "fsdp", "data=x"):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)


GIN_MODEL = 'MODEL_PRESET = "tiny"\nmodel_config.preset = %MODEL_PRESET\nmodel_config.dtype = "bfloat16"\n' \
            'model_config.param_dtype = "bfloat16"\nmodel_config.remat = True\n'
GIN_RUN = "MAX_SEQ_LEN = 256\nROLLOUT_BATCH = 64\nMINI_BATCH = 32\nMICRO_BATCH = 8\n" \
          "some_unregistered_trainer.steps = 1005\n"


@pytest.fixture
def gin_files(tmp_path):
    m, r = tmp_path / "tiny.gin", tmp_path / "run.gin"
    m.write_text(GIN_MODEL)
    r.write_text(GIN_RUN)
    return [str(m), str(r)]


def test_plan_from_gin(gin_files):
    plan, _ = planner.plan_from_args(["--gin_file", gin_files[0], "--gin_file", gin_files[1],
                                      "--mesh", "data=2,fsdp=4", "--tpu", "v5e-8"])
    inp = plan.inputs
    assert (inp.preset, inp.max_seq_len, inp.rollout_batch, inp.mini_batch, inp.micro_batch) == \
        ("tiny", 256, 64, 32, 8)
    assert (inp.cfg.dtype, inp.cfg.param_dtype, inp.cfg.remat) == ("bfloat16", "bfloat16", True)
    assert plan.rows_per_device == 1
    shard = param_shard_elements(inp.cfg, inp.mesh)
    act = activation_bytes(inp.cfg, 1, 256, remat=True)
    assert plan.train_peak == shard * (2 + 4 + 2 + 2 + 4) + act  # params, m+v, reference, grads, f32 accumulator
    assert plan.fits


def test_cli_flags_override_gin(gin_files, capsys):
    rc = planner.main(["--gin_file", gin_files[0], "--gin_file", gin_files[1], "--gin_bindings", "MICRO_BATCH = 16",
                       "--max_seq_len", "128", "--remat", "off", "--param_dtype", "float32", "--no_reference",
                       "--mesh", "fsdp=4", "--tpu", "v4-8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "memory plan: tiny on v4-8 (4 devices, 32 GiB HBM each; mesh data=1 fsdp=4 tensor=1)" in out
    assert "MAX_SEQ_LEN=128 ROLLOUT_BATCH=64 MINI_BATCH=32 MICRO_BATCH=16 (4 per device, 2 accumulation" in out
    assert "remat=off" in out and "2 x float32" in out and "warning: param_dtype" not in out and "(no KL term)" in out
    assert "verdict: fits on v4-8" in out


def test_cli_without_gin_and_check_flag(capsys):
    args = ["--preset", "qwen2.5-7b", "--max_seq_len", "4096", "--rollout_batch", "2560", "--mini_batch", "256",
            "--micro_batch", "8", "--tpu", "v5e-8", "--mesh", "fsdp=8"]
    assert planner.main(args) == 0
    out = capsys.readouterr().out
    assert "7,615,616,512 parameters (7.62B)" in out and "DOES NOT FIT" in out and "verdict: does NOT fit" in out
    assert planner.main(args + ["--check"]) == 1


@pytest.mark.parametrize("args,message", [
    (["--preset", "tiny"], "no value for %MAX_SEQ_LEN"),
    (["--max_seq_len", "8", "--rollout_batch", "8", "--mini_batch", "8", "--micro_batch", "8"],
     "no value for %MODEL_PRESET / model_config.preset"),
    (["--preset", "tiny", "--max_seq_len", "8", "--rollout_batch", "8", "--mini_batch", "8", "--micro_batch", "3"],
     "MINI_BATCH (8) must be a multiple of MICRO_BATCH (3)"),
    (["--preset", "tiny", "--max_seq_len", "8", "--rollout_batch", "8", "--mini_batch", "8", "--micro_batch", "8",
      "--mesh", "fsdp=4", "--tpu", "v5e-8"], "has 4 devices but v5e-8 has 8"),
    (["--gin_file", "/nonexistent/x.gin"], "--gin_file /nonexistent/x.gin: no such file"),
    (["--preset", "qwen9", "--max_seq_len", "8"], "unknown Qwen2 preset"),
])
def test_cli_errors(args, message, capsys):
    assert planner.main(args) == 2
    assert message in capsys.readouterr().err


def test_json_output(capsys):
    import json
    args = ["--preset", "tiny", "--max_seq_len", "64", "--rollout_batch", "16", "--mini_batch", "8",
            "--micro_batch", "4", "--mesh", "fsdp=8", "--tpu", "v5e-8", "--json"]
    assert planner.main(args) == 0
    d = json.loads(capsys.readouterr().out)
    plan, _ = planner.plan_from_args(args)
    assert d["bytes_per_device"] == plan.components and d["num_params"] == 107072 and d["fits"] is True
    assert d["train_peak"] == plan.train_peak and d["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}


def test_cli_entry_is_registered():
    from rexrag_jax.cli import COMMANDS
    assert COMMANDS["plan"][0] == "rexrag_jax.train.planner:main"
