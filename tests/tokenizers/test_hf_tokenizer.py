"""HF tokenizer.json path vs transformers, on a small Qwen-style byte-level BPE built offline."""
import json
import pathlib

import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFBackend

from rexrag_jax.tokenizers import HFTokenizer, load_tokenizer

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer builds the same pipeline).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN25_TEMPLATE = (pathlib.Path(__file__).parent / "qwen25_chat_template.jinja").read_text()

TRAIN_TEXT = [
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time.",
    "You can call a search engine by <search> query </search> and it will return <information> docs </information>.",
    "For example, <answer> Beijing </answer>. Question: who wrote the opera carmen?",
    "Doc 1(Title: \"Carmen\") Carmen is an opera in four acts by the French composer Georges Bizet.",
    "The 2019 season had 1,234 games; isn't it great? They'll say we've won. Naïve café résumé.",
    "東京は日本の首都です。 Paris est la capitale de la France. 🙂 ünïcödé",
] * 20

SAMPLES = [
    "who wrote the opera carmen",
    "<think> I need to search. </think>\n<search> carmen composer </search>",
    "\n\n<information>Doc 1(Title: \"Carmen\") Carmen is an opera.\n</information>\n\n",
    "<answer> Georges Bizet </answer><|im_end|>",
    "<|im_start|>user\nQuestion: 1,234 + 56789?<|im_end|>\n<|im_start|>assistant\n",
    "Naïve café 東京 🙂  tabs\tand   spaces\r\n done",
    "They'll say we've WON'T it's  <tool_call>{\"x\": 1}</tool_call>",
    "",
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen_tok")
    tok = HFBackend(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(d / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": t.startswith("<|")}
             for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "chat_template": QWEN25_TEMPLATE,
        "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": 131072,
        "split_special_tokens": False}))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot], "pad_token_id": eot}))
    return d


@pytest.fixture(scope="module")
def ours(qwen_dir):
    return load_tokenizer(qwen_dir)


@pytest.fixture(scope="module")
def references(qwen_dir):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(qwen_dir))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"))
    return auto, fast


def test_loads_as_hf(ours, qwen_dir):
    assert isinstance(ours, HFTokenizer)
    assert isinstance(load_tokenizer(qwen_dir / "tokenizer.json"), HFTokenizer)


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(ours, references, text):
    for ref in references:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    # Qwen adds no BOS: the default transformers encode is the same ids.
    assert ours.encode(text) == references[0].encode(text)


def test_decode_rejects_ids_outside_vocab(ours):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([0, ours.vocab_size])


def test_encode_batch_and_special_tokens_single_ids(ours):
    assert ours.encode_batch(SAMPLES) == [ours.encode(s) for s in SAMPLES]
    ids = ours.encode("<|im_start|>x<|im_end|><tool_call>")
    assert ids[0] == ours.token_to_id("<|im_start|>") and ids[-2:] == [ours.token_to_id("<|im_end|>"),
                                                                         ours.token_to_id("<tool_call>")]


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_transformers(ours, references, skip):
    for text in SAMPLES:
        ids = ours.encode(text) + [ours.eos_id]
        got = ours.decode(ids, skip_special_tokens=skip)
        assert got == references[0].decode(ids, skip_special_tokens=skip)
        if not skip:
            assert got == text + "<|im_end|>"  # byte-level BPE round-trips exactly


def test_special_ids_match_transformers(ours, references):
    auto = references[0]
    assert ours.eos_id == auto.eos_token_id == ours.token_to_id("<|im_end|>")
    assert ours.pad_id == auto.pad_token_id == ours.token_to_id("<|endoftext|>")
    assert ours.eos_ids == [ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")]
    assert ours.vocab_size == len(auto)
    assert ours.token_to_id("<tool_call>") == auto.convert_tokens_to_ids("<tool_call>")
    assert ours.token_to_id("definitely-not-a-token") is None


CHATS = [
    [{"role": "user", "content": "Question: who wrote carmen?\n"}],
    [{"role": "system", "content": "You are a search agent."},
     {"role": "user", "content": "Question: who wrote carmen?"},
     {"role": "assistant", "content": "<think> search </think>\n<search> carmen </search>"},
     {"role": "user", "content": "<information>Doc 1(Title: Carmen) opera by Bizet</information>"},
     {"role": "assistant", "content": "<answer> Bizet </answer>"}],
    [{"role": "user", "content": "東京? 🙂"}, {"role": "assistant", "content": "Tokyo."},
     {"role": "user", "content": "and 'quotes' \"double\" & <b>tags</b>"}],
]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, references, chat, gen):
    want = references[0].apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    got = ours.apply_chat_template(chat, add_generation_prompt=gen)
    assert got == want
    assert got.endswith("<|im_start|>assistant\n") == gen


def test_chat_template_tools_tojson_not_html_escaped(ours, references):
    tools = [{"type": "function", "function": {"name": "search", "description": "wiki <search> & more",
                                               "parameters": {"type": "object", "properties": {}}}}]
    chat = [{"role": "user", "content": "hi"}]
    want = references[0].apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    got = ours.apply_chat_template(chat, tools=tools)
    assert got == want and "wiki <search> & more" in got


def test_raise_exception_and_bad_messages(qwen_dir):
    tmpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    tok = load_tokenizer(qwen_dir, chat_template=tmpl)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(Exception, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="message 0"):
        tok.apply_chat_template(["not a dict"])


def test_chat_template_jinja_file_takes_priority(qwen_dir, tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_text((qwen_dir / f).read_text())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"


def test_eos_from_generation_config_without_tokenizer_config(qwen_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((qwen_dir / "tokenizer.json").read_text())
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template is None and tok.eos_id == tok.token_to_id("<|endoftext|>")  # vocabulary fallback
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    im_end = tok.token_to_id("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_id == im_end and tok.pad_id == im_end


def test_bad_inputs_name_the_file(qwen_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((qwen_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>",\n "pad_token": }')
    with pytest.raises(ValueError, match=r"tokenizer_config.json: invalid JSON at line 2"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in the vocabulary"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 999999}')
    with pytest.raises(ValueError, match="generation_config.json.*outside"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.json")
    broken = tmp_path / "x" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizers JSON"):
        load_tokenizer(broken)


# Whitespace control matters here: transformers renders with trim_blocks and lstrip_blocks on.
BLOCKY_TEMPLATE = """{% for m in messages %}
    {% if m['role'] == 'system' %}
<<SYS>>{{ m['content'] | trim }}<</SYS>>
    {% else %}
[{{ m['role'] | upper }}] {{ m['content'] }}
    {% endif %}
{% endfor %}
{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}
turns={{ ns.n }} eos={{ eos_token }} {{ {'k': '<é>'} | tojson }}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}"""


@pytest.mark.parametrize("gen", [True, False])
def test_whitespace_control_and_globals_match_transformers(qwen_dir, references, gen):
    ours = load_tokenizer(qwen_dir, chat_template=BLOCKY_TEMPLATE)
    chat = CHATS[1]
    want = references[0].apply_chat_template(chat, chat_template=BLOCKY_TEMPLATE, tokenize=False,
                                             add_generation_prompt=gen)
    assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want
    assert "turns=5 eos=<|im_end|>" in want and '"<é>"' in want


def test_reference_is_the_qwen2_class(references):
    assert type(references[0]).__name__ == "Qwen2Tokenizer"
