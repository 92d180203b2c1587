"""SPEC §1 prompt text and chat-template rendering (Qwen-style template via jinja2 and via transformers)."""
import jinja2
import pytest

from rexrag_jax.data import build_prompt_text, render_prompt

# SPEC §1, typed out independently of the module (note the reference's "as your want").
SPEC_PREFIX = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every "
               "time you get new information. After reasoning, if you find you lack some knowledge, you can call "
               "a search engine by <search> query </search> and it will return the top searched results between "
               "<information> and </information>. You can search as many times as your want. If you find no "
               "further external knowledge needed, you can directly provide the answer inside <answer> and "
               "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: ")

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


class StandInTokenizer:
    """The rexrag_jax.tokenizers interface's apply_chat_template, rendered with jinja2."""

    def __init__(self):
        self.template = jinja2.Environment().from_string(QWEN_TEMPLATE)
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.calls.append((messages, add_generation_prompt))
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("question,expected_q", [
    ("who wrote hamlet", "who wrote hamlet?"),
    ("  Who wrote Hamlet?  \n", "Who wrote Hamlet?"),
    ("what is 1+1 ?", "what is 1+1 ?"),
])
def test_build_prompt_text(question, expected_q):
    assert build_prompt_text(question) == SPEC_PREFIX + expected_q + "\n"


def test_build_prompt_text_rejects_empty():
    with pytest.raises(ValueError):
        build_prompt_text("   ")
    with pytest.raises(TypeError):
        build_prompt_text(None)


def test_render_prompt_with_stand_in():
    tok = StandInTokenizer()
    out = render_prompt(tok, "who wrote hamlet")
    assert tok.calls == [([{"role": "user", "content": SPEC_PREFIX + "who wrote hamlet?\n"}], True)]
    assert out == QWEN_SYSTEM + "<|im_start|>user\n" + SPEC_PREFIX + "who wrote hamlet?\n<|im_end|>\n<|im_start|>assistant\n"


def test_render_prompt_with_transformers_tokenizer_matches():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    hf.chat_template = QWEN_TEMPLATE
    assert render_prompt(hf, "who wrote hamlet") == render_prompt(StandInTokenizer(), "who wrote hamlet")


def test_render_prompt_rejects_token_ids():
    class IdsTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return [1, 2, 3]

    with pytest.raises(TypeError, match="expected the rendered string"):
        render_prompt(IdsTokenizer(), "q")
