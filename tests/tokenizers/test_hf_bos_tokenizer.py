"""A Llama-3-style tokenizer.json whose post-processor adds BOS: our encode never adds it (rollouts
concatenate pieces), the template sees bos_token/eos_token from tokenizer_config.json, and both match
transformers."""
import json

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFBackend

from rexrag_jax.tokenizers import load_tokenizer

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
TEXTS = ["Question: who wrote carmen?", "<search> bizet </search>", "  spaced\n\nlines ", "é 東京"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_tok")
    tok = HFBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 10 + ["The opera Carmen was written by Georges Bizet."] * 10,
                            trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                special_tokens=[BOS, EOS]))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (EOT, "<|start_header_id|>", "<|end_header_id|>")])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
        "chat_template": LLAMA3_STYLE_TEMPLATE, "clean_up_tokenization_spaces": False}))
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(EOT)]}))
    return d


@pytest.fixture(scope="module")
def ref(llama_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(llama_dir))


def test_encode_never_adds_bos(llama_dir, ref):
    ours = load_tokenizer(llama_dir)
    for t in TEXTS:
        ids = ours.encode(t)
        assert ids == ref.encode(t, add_special_tokens=False)
        assert ref.encode(t) == [ours.token_to_id(BOS)] + ids  # the peer's default does add it


def test_template_sees_bos_and_eos_ids(llama_dir, ref):
    ours = load_tokenizer(llama_dir)
    chat = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "who wrote carmen?"}]
    for gen in (True, False):
        want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want and want.startswith(BOS)
    assert ours.eos_id == ref.eos_token_id == ours.token_to_id(EOT)
    assert ours.eos_ids == [ours.token_to_id(EOT), ours.token_to_id(EOS)]
    assert ours.pad_id == ours.eos_id  # no pad anywhere: falls back to eos
