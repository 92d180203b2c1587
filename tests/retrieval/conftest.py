"""Retrieval test fixtures: a tiny random BERT behind the real MiniLM tokenizer (fast to compile)."""
import os
import shutil

import jax
import pytest

from rexrag_jax.models.bert import BertConfig, init_params
from rexrag_jax.models.bert.hf_io import default_minilm_dir
from rexrag_jax.retrieval.encoder import TextEncoder, load_bert_tokenizer


def make_tiny_encoder(name="tiny-bert", seed=0, dtype="float32", **kw):
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                     max_position_embeddings=128, dtype=dtype)
    kw.setdefault("max_length", 64)
    kw.setdefault("batch_size", 64)
    tok = load_bert_tokenizer(default_minilm_dir(), kw["max_length"])
    return TextEncoder(cfg, init_params(cfg, jax.random.PRNGKey(seed)), tok, name=name, **kw)


@pytest.fixture(scope="session")
def tiny_encoder():
    return make_tiny_encoder()


@pytest.fixture(scope="session")
def make_encoder():
    return make_tiny_encoder


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random HF BERT dir with the MiniLM tokenizer (for gin-built encoders and the CLIs)."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny_hf")
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(cfg).save_pretrained(d)
    shutil.copy(os.path.join(default_minilm_dir(), "tokenizer.json"), d)
    return str(d)
