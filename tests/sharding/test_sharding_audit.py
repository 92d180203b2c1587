"""Sharding audit of the compiled update / log-prob programs on a small fake mesh (8 CPU devices, set by
tests/conftest.py before jax is imported): no big parameter or optimizer leaf replicated on fsdp > 1, the
audit catches a planted replicated leaf, and the HLO collective counts match hand-computed values."""
import math

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import param_shapes
from rexrag_jax.sharding import audit, make_mesh, param_shardings
from rexrag_jax.train.aot import ARG_NAMES, AotShapes, compile_and_audit

# 3 layers, so the layer loop (trip 3) differs from the micro-batch loop (2) and the log-prob chunks (4).
CFG = Qwen2Config.from_preset("tiny", num_layers=3, tie_word_embeddings=False, dtype="bfloat16", remat=True)
SHAPES = AotShapes(seq_len=32, micro_batch=8, mini_batch=16, logprob_rows=8, logprob_chunk=8, kl=True,
                   engine_rows=8, engine_len=64, prefill_chunk=16, decode_chunk=4)
BIG = 16 * 1024  # "big" for the tiny model: embed / lm_head (128 KiB) and the stacked kernels (>= 24 KiB)


def _leaf_bytes():
    return {k: v for k, v in jax.tree_util.tree_flatten_with_path(
        param_shapes(CFG), is_leaf=lambda x: isinstance(x, tuple))[0]}


def test_eight_fake_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set --xla_force_host_platform_device_count=8"


@pytest.mark.parametrize("program", ["update", "logprob"])
def test_no_big_state_leaf_replicated_on_fsdp(program):
    res = compile_and_audit(program, CFG, make_mesh(1, 4, 2), SHAPES, min_replicated_bytes=BIG)
    assert res["replicated_state"] == [], [r.path for r in res["replicated_state"]]
    # not vacuous: the program takes big state leaves (all sharded) ...
    big = [s for s in _leaf_bytes().values() if 4 * math.prod(s) >= BIG]
    assert len(big) >= 8
    # ... and the same check with no size floor does see the replicated norms (sharded by no rule)
    every = audit.replicated_inputs(res["compiled"], res["args"], 1, ARG_NAMES[program])
    assert "params['layers']['attn_norm']" in {r.path for r in every}


def test_audit_detects_a_planted_replicated_leaf():
    mesh = make_mesh(1, 4, 2)
    sh = param_shardings(CFG, mesh)
    sh["lm_head"] = NamedSharding(mesh, PartitionSpec())  # deliberately replicated: 64 x 512 f32 = 128 KiB
    res = compile_and_audit("update", CFG, mesh, SHAPES, shardings=sh, min_replicated_bytes=BIG)
    paths = sorted(r.path for r in res["replicated_state"])
    # the param, and its two Adam moments (the optimizer shardings follow the params, as in the trainer)
    assert len(paths) == 3 and all("lm_head" in p for p in paths), paths
    assert paths[0].startswith("opt_state") and paths[2] == "params['lm_head']"
    assert {r.nbytes for r in res["replicated_state"]} == {64 * 512 * 4}


HLO = """HloModule m, entry_computation_layout={()->f32[]}

%inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %ag = f32[4,8]{1,0} all-gather(f32[1,8]{1,0} %x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %ag)
}

%inner_cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%outer_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %w = (s32[], f32[4,8]) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %rs = bf16[2,8]{1,0} reduce-scatter(bf16[8,8]{1,0} %y), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %ag)
}

%dyn_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %cp = f32[16]{0} collective-permute(f32[16]{0} %z), channel_id=5, source_target_pairs={{0,1}}
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %ag)
}

ENTRY %main (a: f32[4,8]) -> f32[] {
  %w0 = (s32[], f32[4,8]) while(%init), condition=%inner_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %w1 = (s32[], f32[4,8]) while(%init), condition=%inner_cond, body=%dyn_body
  %ar = (f32[2]{0}, bf16[4]{0}) all-reduce(f32[2]{0} %a, bf16[4]{0} %b), channel_id=3, to_apply=%add
  %ags = ((f32[1,8]{1,0}), f32[4,8]{1,0}) all-gather-start(f32[1,8]{1,0} %x), channel_id=4, dimensions={0}
  %agd = f32[4,8]{1,0} all-gather-done(%ags)
  ROOT %r = f32[] constant(0)
}
"""


def test_collective_counts_on_hand_written_hlo():
    ops = {o.name: o for o in audit.collectives(HLO, unknown_trip=7)}
    assert set(ops) == {"ag", "rs", "cp", "ar", "ags"}
    assert (ops["ag"].executions, ops["ag"].result_bytes, ops["ag"].trips) == (15, 4 * 8 * 4, (3, 5))
    assert (ops["rs"].executions, ops["rs"].result_bytes, ops["rs"].trips) == (3, 2 * 8 * 2, (3,))
    assert (ops["cp"].executions, ops["cp"].trips) == (7, (-1,))  # unknown trip count: the bound given
    assert (ops["ar"].executions, ops["ar"].result_bytes) == (1, 2 * 4 + 4 * 2)
    assert (ops["ags"].kind, ops["ags"].result_bytes) == ("all-gather", 4 * 8 * 4)
    s = audit.summarize(list(ops.values()), num_layers=5)
    assert s["per_call"]["all-gather"] == {"count": 16, "bytes": 15 * 128 + 128}
    assert s["per_call"]["reduce-scatter"] == {"count": 3, "bytes": 3 * 32}
    assert s["per_layer"]["all-gather"] == {"count": 1, "bytes": 128}  # only %ag sits in the trip-5 loop
    assert "all-gather" in audit.format_collectives(s)


def _layer_kernel_bytes(dtype_bytes, tensor):
    D, H, KV, Hd, F = CFG.hidden_size, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, CFG.intermediate_size
    return dtype_bytes * (D * H * Hd + 2 * D * KV * Hd + H * Hd * D + 3 * D * F) // tensor


def test_fsdp_update_gathers_every_layer_weight_and_reduces_gradients():
    res = compile_and_audit("update", CFG, make_mesh(1, 8, 1), SHAPES)
    layer, call = res["collectives"]["per_layer"], res["collectives"]["per_call"]
    # forward: each of the 7 kernels of a layer is gathered from its fsdp shards (then again in the remat
    # backward); at least their bf16 size per layer, at most 3 float32 copies
    assert layer["all-gather"]["count"] >= 7
    assert _layer_kernel_bytes(2, 1) <= layer["all-gather"]["bytes"] <= 3 * _layer_kernel_bytes(4, 1)
    # every gradient leaves the layer loop reduced over fsdp (reduce-scatter, or all-reduce on CPU)
    reduced = layer["all-reduce"]["bytes"] + 8 * layer["reduce-scatter"]["bytes"]
    assert reduced >= _layer_kernel_bytes(4, 1)
    n_layers_runs = SHAPES.n_micro * CFG.num_layers
    assert call["all-gather"]["count"] >= 7 * n_layers_runs


def test_data_parallel_update_has_no_weight_gathers():
    res = compile_and_audit("update", CFG, make_mesh(8, 1, 1), SHAPES)
    layer, call = res["collectives"]["per_layer"], res["collectives"]["per_call"]
    assert layer["all-gather"]["bytes"] < _layer_kernel_bytes(2, 1) // 4  # weights replicated: nothing to gather
    n_params = sum(math.prod(s) for s in _leaf_bytes().values())
    # ... but every float32 gradient is all-reduced across the 8 data-parallel replicas, every micro-batch
    assert call["all-reduce"]["bytes"] >= 4 * n_params


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_logprobs_never_gather_the_output_table(tied):
    """The vocab-parallel head (qwen2.model.vocab_parallel_head): inside the update's micro-batch x chunk
    loops no collective of the output head moves the [V, D] table (an all-gather of it, an all-reduce of
    its gradient); what crosses devices per chunk is hidden states and [rows, chunk] statistics. Before
    it, XLA gathered the table in every chunk of every micro-batch."""
    cfg = CFG.replace(tie_word_embeddings=tied)
    res = compile_and_audit("update", cfg, make_mesh(1, 8, 1), SHAPES)
    table = cfg.vocab_size * cfg.hidden_size * 2  # bf16 [V, D]: 128 KiB; its f32 gradient twice that
    head = [op for op in res["ops"] if len(op.trips) >= 2 and any(
        e in op.op_name for e in ("btd,vd->btv", "btd,dv->btv"))]
    big = [(op.kind, op.result_bytes, op.trips) for op in head if op.result_bytes >= table // 2]
    assert big == []
