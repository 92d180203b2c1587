"""save_tokenizer_for_hf: `transformers.AutoTokenizer.from_pretrained(export)` gives exactly our ids and
renders our chat prompt, for a SentencePiece model (converted tokenizer.json) and a tokenizer.json one."""
import json
import os
import stat

import pytest

from rexrag_jax.data.prompts import build_prompt_text
from rexrag_jax.tokenizers import HFTokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece
from rexrag_jax.tokenizers.hf_export import save_tokenizer_for_hf

from test_hf_tokenizer import SAMPLES, qwen_dir  # noqa: F401  (fixture)

transformers = pytest.importorskip("transformers")

DEMO_LIKE = [
    "<think> I need the founder of Zelko. </think><search> Zelko founder </search>",
    "\n\n<information>Doc 1(Title: \"Zelko\") Zelko is a company founded by Marvo in 1923.\n"
    "Doc 2(Title: \"Marvo\") Marvo was born in Tavik.</information>\n\n",
    "<think> The birthplace of Marvo is Tavik. </think><answer> Tavik </answer>",
    "\nMy action is invalid. ",
    "Naïve café 東京 🙂  tabs\tand   spaces\r\n done 12345",
    "  leading and trailing  ", "", "x<search>y</search>z<|im_end|>",
]


@pytest.fixture(scope="module")
def spm_export(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm_export")
    lines = [build_prompt_text(f"who founded Zelko {i}?") for i in range(5)] + DEMO_LIKE * 10 + [
        "The founder of Zelko is Marvo.", "Doc 1(Title: \"Zelko\") Zelko is a company."] * 20
    model = train_sentencepiece(lines, str(d / "t"), 500)
    out = d / "export"
    written = save_tokenizer_for_hf(model, out)
    return model, out, written


def _texts():
    ours = [build_prompt_text(q) for q in ("who founded Zelko?", "what is 2 + 2, and who's \"Marvo\"?")]
    return ours + DEMO_LIKE + SAMPLES[:-1]


def test_sentencepiece_export_gives_our_ids_and_chat_prompt(spm_export):
    model, out, written = spm_export
    assert set(written) == {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                            "special_tokens_map.json", "chat_template.jinja", "tokenization_rexrag.py"}
    ours = SentencePieceTokenizer(model)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert not isinstance(hf, transformers.Qwen2Tokenizer)
    for text in _texts():
        assert hf(text)["input_ids"] == ours.encode(text), text            # no BOS/EOS added either
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text), text
        assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text)), text
    messages = [{"role": "user", "content": build_prompt_text("who founded Zelko?")}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(messages)
    assert hf(rendered, add_special_tokens=False)["input_ids"] == ours.encode(rendered)
    assert hf.eos_token == "<|endoftext|>" and hf.convert_tokens_to_ids("<|im_end|>") == ours.token_to_id("<|im_end|>")
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special["eos_token"] == "<|endoftext|>" and special["pad_token"] == "<|endoftext|>"
    # our own loader still reads the SentencePiece model of the export (EOS ids incl. <|im_end|>)
    again = load_tokenizer(out)
    assert isinstance(again, SentencePieceTokenizer) and again.eos_ids == ours.eos_ids


def test_tokenizer_json_export_copies_files_and_matches(qwen_dir, tmp_path):  # noqa: F811
    out = tmp_path / "export"
    written = save_tokenizer_for_hf(qwen_dir, out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)
    ours = load_tokenizer(qwen_dir)
    assert isinstance(load_tokenizer(out), HFTokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLES + DEMO_LIKE:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text), text
    messages = [{"role": "user", "content": build_prompt_text("q?")}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages)
    # beside a qwen2 config.json (a full policy export) AutoTokenizer builds Qwen2Tokenizer: still our ids
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 1024}))
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLES + DEMO_LIKE:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text), text
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages)
    # a tokenizer.json path works the same as its directory
    out2 = tmp_path / "export2"
    assert save_tokenizer_for_hf(qwen_dir / "tokenizer.json", out2) == written


def test_demo_export_policy_is_0755_and_loads_in_transformers(spm_export, tmp_path):
    import jax

    from rexrag_jax.demo import export_policy
    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.models.qwen2.model import init_params

    model, _, _ = spm_export
    tok = SentencePieceTokenizer(model)
    cfg = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    out = export_policy(params, cfg, model, str(tmp_path / "policy"))
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"} <= set(os.listdir(out))
    # transformers 5 would build a byte-level Qwen2Tokenizer for any dir whose config.json says model_type
    # qwen2; the export's auto_map keeps tokenizer.json as it is, with and without trust_remote_code
    for kwargs in ({}, {"trust_remote_code": False}, {"trust_remote_code": True}):
        hf = transformers.AutoTokenizer.from_pretrained(out, **kwargs)
        for text in _texts():
            assert hf.encode(text, add_special_tokens=False) == tok.encode(text), (kwargs, text)
        msgs = [{"role": "user", "content": "who founded Zelko?"}]
        assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            tok.apply_chat_template(msgs), kwargs
