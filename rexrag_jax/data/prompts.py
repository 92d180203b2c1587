"""The Search-R1 user prompt (SPEC §1) and its chat-template rendering."""
from __future__ import annotations

import inspect

PROMPT_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by <search> query </search> and it will return the top searched results between <information> "
    "and </information>. You can search as many times as your want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)


def build_prompt_text(question: str, note: str = "") -> str:
    """PROMPT_TEMPLATE with q = question.strip(), plus "?" when q does not already end with one.

    note: an extra instruction sentence placed right before "Question:" (RAPO's sentence about
    `<retrieve>` blocks, rapo.hybrid_rollout); "" leaves the Search-R1 prompt unchanged."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}")
    q = question.strip()
    if not q:
        raise ValueError("question is empty")
    if not q.endswith("?"):
        q += "?"
    text = PROMPT_TEMPLATE.format(question=q)
    if note and note.strip():
        head, tail = PROMPT_TEMPLATE.split("Question: {question}")
        text = f"{head}{note.strip()} Question: {q}{tail}"
    return text


def render_prompt(tokenizer, question: str, note: str = "") -> str:
    """tokenizer.apply_chat_template([{"role": "user", "content": build_prompt_text(q)}], add_generation_prompt=True).

    Works with rexrag_jax.tokenizers.Tokenizer and with a transformers tokenizer (which would
    tokenize by default, so `tokenize=False` is passed when its signature has that argument).
    """
    messages = [{"role": "user", "content": build_prompt_text(question, note)}]
    kwargs = {"add_generation_prompt": True}
    try:
        if "tokenize" in inspect.signature(tokenizer.apply_chat_template).parameters:
            kwargs["tokenize"] = False
    except (TypeError, ValueError):  # builtins / C extensions without a signature
        pass
    out = tokenizer.apply_chat_template(messages, **kwargs)
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected the rendered string")
    return out
