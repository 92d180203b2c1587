"""BERT-family sentence encoder (E5, MiniLM) as pure functions + offline HF loading."""
from rexrag_jax.models.bert.config import BertConfig
from rexrag_jax.models.bert.hf_io import default_minilm_dir, load_hf_bert
from rexrag_jax.models.bert.model import embed, forward, init_params, l2_normalize, mean_pool

__all__ = ["BertConfig", "default_minilm_dir", "embed", "forward", "init_params", "l2_normalize",
           "load_hf_bert", "mean_pool"]
