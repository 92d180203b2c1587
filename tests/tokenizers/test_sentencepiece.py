"""SentencePiece path: training helper, exact round trips, single-token user symbols, ChatML template."""
import os

import pytest
import sentencepiece as spm

from rexrag_jax.tokenizers import (AGENT_TAGS, CHATML_TOKENS, DEFAULT_USER_SYMBOLS, SentencePieceTokenizer,
                                   load_tokenizer, train_sentencepiece)

LINES = [
    "Answer the given question. You must conduct reasoning inside <think> and </think> first.",
    "Call a search engine by <search> query </search>; results come in <information> </information>.",
    "Provide the answer inside <answer> and </answer>, for example <answer> Beijing </answer>.",
    "Doc 1(Title: \"Carmen\") Carmen is an opera in four acts by Georges Bizet, first performed in 1875.",
    "The capital of France is Paris. The capital of Japan is Tokyo. Who wrote Hamlet? Shakespeare.",
] * 30 + ["naïve café résumé 東京"]


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    return train_sentencepiece(LINES, tmp_path_factory.mktemp("spm") / "demo", vocab_size=420)


@pytest.fixture(scope="module")
def tok(sp_path):
    return load_tokenizer(sp_path)


def test_layout_of_ids(tok, sp_path):
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(load_tokenizer(os.path.dirname(sp_path)),
                                                                  SentencePieceTokenizer)
    assert [tok.id_to_token(i) for i in range(2 + len(DEFAULT_USER_SYMBOLS))] == \
        ["<unk>", "<|endoftext|>", *DEFAULT_USER_SYMBOLS]
    assert tok.eos_id == tok.pad_id == 1
    assert tok.eos_ids == [1, tok.token_to_id("<|im_end|>")]
    assert tok.vocab_size == spm.SentencePieceProcessor(model_file=sp_path).get_piece_size() <= 420


@pytest.mark.parametrize("sym", CHATML_TOKENS + AGENT_TAGS)
def test_user_symbols_are_single_tokens(tok, sym):
    assert tok.encode(sym) == [tok.token_to_id(sym)]
    ids = tok.encode(f"x{sym}y")  # glued to neighbours, still one token
    assert tok.token_to_id(sym) in ids and tok.decode(ids) == f"x{sym}y"


@pytest.mark.parametrize("text", [
    "<think> I should search. </think>\n<search> carmen composer </search>",
    "\n\n<information>Doc 1(Title: \"Carmen\") opera\n</information>\n\n",
    "  leading spaces, double  spaces,\ttabs and trailing newline\n",
    "unseen characters: Ωμέγα 🙂 ñ ẞ and digits 0123456789",
    "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n<answer> Paris </answer>",
])
def test_round_trip_exact(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert 0 not in ids  # byte fallback: never <unk>


def test_encode_batch(tok):
    texts = ["<think> a </think>", "", "Doc 1(Title: x)\n", "東京 🙂"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_concatenation_is_stable(tok):
    # No dummy-prefix space: encoding pieces separately decodes to the concatenated text.
    a, b = "Question: who wrote Hamlet?\n", "<think> maybe Shakespeare </think>"
    assert tok.decode(tok.encode(a) + tok.encode(b)) == a + b


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n<answer> x </answer><|im_end|>") + [tok.eos_id]
    assert tok.decode(ids) == "<|im_start|>assistant\n<answer> x </answer><|im_end|><|endoftext|>"
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<answer> x </answer>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_chatml_template(tok):
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    body = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n" \
           "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
    assert tok.apply_chat_template(chat, add_generation_prompt=False) == body
    assert tok.apply_chat_template(chat) == body + "<|im_start|>assistant\n"
    ids = tok.encode(tok.apply_chat_template(chat[1:2]))
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.token_to_id("<|im_end|>")) == 1


def test_token_to_id_unknown(tok):
    assert tok.token_to_id("<unk>") == 0
    assert tok.token_to_id("no-such-piece-xyz") is None


def test_training_errors_and_atomic_output(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_sentencepiece(LINES, tmp_path / "m", vocab_size=100)
    with pytest.raises(ValueError, match="no non-empty training lines"):
        train_sentencepiece(["", ""], tmp_path / "m", vocab_size=400)
    assert not list(tmp_path.iterdir())  # nothing half-written
    with pytest.raises(ValueError, match="not a loadable SentencePiece"):
        bad = tmp_path / "bad.model"
        bad.write_bytes(b"not a model")
        load_tokenizer(bad)
