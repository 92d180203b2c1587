"""BERT encoder parity: JAX pure functions vs transformers (tiny random model) and sentence-transformers."""
import os

import numpy as np
import pytest

import jax.numpy as jnp

from rexrag_jax.models.bert import embed, forward, load_hf_bert
from rexrag_jax.models.bert.hf_io import default_minilm_dir, load_torch_state_dict
from rexrag_jax.retrieval.corpus import read_corpus

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_hf_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorm/bias values so a mis-mapped weight cannot hide
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    model = _tiny_hf_model()
    st_dir, bin_dir = tmp_path_factory.mktemp("tiny_st"), tmp_path_factory.mktemp("tiny_bin")
    model.save_pretrained(st_dir, safe_serialization=True)
    model.config.save_pretrained(bin_dir)
    torch.save(model.state_dict(), os.path.join(bin_dir, "pytorch_model.bin"))
    return model, str(st_dir), str(bin_dir)


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 99, size=(3, 17)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_tiny_bert_safetensors_parity(tiny_dirs):
    model, st_dir, _ = tiny_dirs
    cfg, params = load_hf_bert(st_dir)
    ids, mask = _batch()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    out = np.asarray(forward(params, jnp.asarray(ids), jnp.asarray(mask), cfg))
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=1e-5, rtol=1e-5)
    # Pooled + normalised embedding vs the same formula in torch.
    m = torch.tensor(mask, dtype=torch.float32)[..., None]
    pooled = (torch.tensor(ref) * m).sum(1) / m.sum(1)
    ref_emb = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    emb = np.asarray(embed(params, jnp.asarray(ids), jnp.asarray(mask), cfg))
    np.testing.assert_allclose(emb, ref_emb, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, atol=1e-6)


def test_torch_free_bin_loader_matches_safetensors(tiny_dirs):
    model, st_dir, bin_dir = tiny_dirs
    sd = load_torch_state_dict(os.path.join(bin_dir, "pytorch_model.bin"))
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(sd[k], v.numpy(), err_msg=k)
    _, p_st = load_hf_bert(st_dir)
    _, p_bin = load_hf_bert(bin_dir)
    import jax

    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p_st), jax.tree_util.tree_leaves(p_bin)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_missing_weight_names_the_key(tiny_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, st_dir, _ = tiny_dirs
    sd = load_file(os.path.join(st_dir, "model.safetensors"))
    del sd["encoder.layer.1.output.dense.bias"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(st_dir, "config.json")).read())
    with pytest.raises(KeyError, match="encoder.layer.1.output.dense.bias"):
        load_hf_bert(tmp_path)


def test_minilm_matches_sentence_transformers(shared_data):
    st = pytest.importorskip("sentence_transformers")
    from rexrag_jax.retrieval.encoder import TextEncoder

    passages = read_corpus(shared_data / "corpus" / "wiki18_sample_1000.jsonl")
    texts = [p.contents for p in passages[:6]] + ["who founded genentech?", "a"]
    ref = st.SentenceTransformer(default_minilm_dir(), device="cpu").encode(texts, convert_to_numpy=True)
    enc = TextEncoder.from_pretrained(default_minilm_dir(), name="all-MiniLM-L6-v2", batch_size=8)
    out = enc.encode(texts, kind="passage", progress=False)
    assert out.shape == (8, 384)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_data_parallel_and_bf16_encoding(make_encoder, shared_data):
    import jax

    texts = [p.contents for p in read_corpus(shared_data / "corpus" / "wiki18_sample_1000.jsonl")[:12]]
    ref = make_encoder(batch_size=16).encode(texts)
    assert jax.local_device_count() == 8   # tests/conftest.py: 8 fake CPU devices
    dp = make_encoder(batch_size=16, data_parallel=True)
    assert dp._sharding is not None
    np.testing.assert_allclose(dp.encode(texts), ref, atol=1e-5)
    out = make_encoder(batch_size=16, dtype="bfloat16").encode(texts)
    assert out.dtype == np.float32
    cos = (out * ref).sum(-1)
    assert cos.min() > 0.99 and not np.allclose(out, ref, atol=1e-6)   # bf16 path really taken


def test_e5_prefixes_and_truncation(make_encoder):
    plain = make_encoder()
    e5 = make_encoder(query_prefix="query: ", passage_prefix="passage: ")
    np.testing.assert_allclose(e5.encode(["who is evan"], kind="query"), plain.encode(["query: who is evan"]), atol=1e-6)
    np.testing.assert_allclose(e5.encode(["evan morris"], kind="passage"), plain.encode(["passage: evan morris"]), atol=1e-6)
    assert not np.allclose(e5.encode(["x y"], kind="query"), e5.encode(["x y"], kind="passage"))
    long_ids = plain.tokenize(["word " * 500])[0]
    assert len(long_ids) == plain.max_length and long_ids[-1] == plain.tokenizer.token_to_id("[SEP]")
    with pytest.raises(ValueError, match="kind must be"):
        plain.encode(["a"], kind="doc")


def test_small_batches_run_a_compiled_larger_bucket(make_encoder):
    """Batches of 16, 3, 5 and 1 queries of <= 16 tokens all run one [32, 16] program (REUSE_FLOOR tokens)
    with the embeddings of encoding them alone; a 64-token query runs [8, 64], and after a [32, 64] batch
    a [16, 64] one runs that (within REUSE_COST) instead of compiling."""
    from rexrag_jax.retrieval.encoder import REUSE_FLOOR

    enc = make_encoder(name="reuse-bert", seed=3)
    assert REUSE_FLOOR == 512
    texts = [f"who founded company number {i}" for i in range(16)]
    first = enc.encode(texts, kind="query")
    few = enc.encode(texts[:3], kind="query")
    five = enc.encode(texts[4:9], kind="query")
    one = enc.encode(texts[5:6], kind="query")
    assert enc._compiled == {(32, 16)}
    alone = np.concatenate([enc.encode([t], kind="query") for t in texts[:3]])
    np.testing.assert_allclose(few, first[:3], atol=1e-5)
    np.testing.assert_allclose(few, alone, atol=1e-5)
    np.testing.assert_allclose(five, first[4:9], atol=1e-5)
    np.testing.assert_allclose(one, first[5:6], atol=1e-5)
    long = ["word " * 60]
    enc.encode(long, kind="query")
    assert enc._compiled == {(32, 16), (8, 64)}
    enc.encode(long * 32, kind="query")
    enc.encode(long * 9, kind="query")
    assert enc._compiled == {(32, 16), (8, 64), (32, 64)}
