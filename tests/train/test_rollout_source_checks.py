"""SearchRollout refuses a tokenizer without a chat template when it is built (one line, before model init),
not at the first rollout after minutes of compiles (found by benchmarks/reshard_resume.py)."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from rexrag_jax.config.errors import StartupInputError
from rexrag_jax.train.rollout_source import SearchRollout


def _tokenizer_dir(tmp_path, template):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["who wrote the opera carmen?"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_tokenizer_without_chat_template_is_refused_at_construction(tmp_path):
    path = _tokenizer_dir(tmp_path, None)
    with pytest.raises(StartupInputError, match=r"SearchRollout.tokenizer_path: .* has no chat template") as e:
        SearchRollout(tokenizer_path=path, retriever=None)
    assert path in str(e.value).splitlines()[0]  # the line `rexrag train` prints (gin appends "In call to ...")


def test_tokenizer_with_chat_template_is_accepted(tmp_path):
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    ro = SearchRollout(tokenizer_path=_tokenizer_dir(tmp_path, template), retriever=None)
    assert ro.tokenizer.apply_chat_template([{"role": "user", "content": "q"}]).startswith("<|im_start|>user\nq")
