"""Chat-template rendering compatible with transformers' `apply_chat_template(tokenize=False)`.

Hugging Face chat templates are Jinja programs. transformers renders them in an
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the `loopcontrols` extension,
a `tojson` filter that does not HTML-escape, and the globals `raise_exception`, `strftime_now`,
`namespace`, `dict`. The template sees `messages`, `tools`, `documents`, `add_generation_prompt` and the
tokenizer's special tokens (`bos_token`, `eos_token`, ...). We reproduce exactly that environment so that
a rendered prompt is byte-identical to what verl / transformers would feed the model.
"""
from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Qwen-style ChatML with no default system message (used for SentencePiece models, which carry no template).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's built-in tojson HTML-escapes '<', '>', '&'; transformers overrides it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes (no sandbox escape through dunders)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile `source` in the transformers-compatible sandbox (cached: templates are reused every step)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["dict"] = dict
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                         special_tokens: Mapping[str, str] | None = None, **kwargs) -> str:
    """Render `messages` ([{"role", "content"}, ...]) with the template `source`.

    Message keys whose value is None are dropped (as transformers does) and `tools`/`documents` default to
    None. Extra kwargs are visible to the template and override special tokens of the same name.
    """
    if not messages:
        raise ValueError("apply_chat_template: the conversation is empty; expected at least one message")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"apply_chat_template: message {i} must be a dict with 'role' and 'content', got {m!r}")
        chat.append({k: v for k, v in m.items() if v is not None})
    context = {"tools": None, "documents": None, **(special_tokens or {}), **kwargs}
    return compile_chat_template(source).render(messages=chat, add_generation_prompt=add_generation_prompt,
                                                **context)
