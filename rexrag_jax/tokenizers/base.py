"""The one tokenizer interface every stage uses (rollout, data, generation, evaluation)."""
from __future__ import annotations

import abc
from typing import Any, Mapping, Sequence

from rexrag_jax.tokenizers.chat_template import render_chat_template

# Tags of the Search-R1 / REX-RAG action format; SentencePiece models keep each one a single token.
AGENT_TAGS = ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
              "<information>", "</information>")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


class Tokenizer(abc.ABC):
    """Text <-> token ids plus the chat template.

    `encode` never adds BOS/EOS: rollouts tokenize pieces (prompt, observation, probe prompt) separately and
    concatenate them, so any automatic special token would be repeated mid-sequence.
    """

    chat_template: str | None = None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Same ids as [encode(t) for t in texts] (subclasses batch it natively)."""
        return [self.encode(t) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (added tokens included); the model's embedding may be larger."""

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    @abc.abstractmethod
    def eos_ids(self) -> list[int]:
        """All ids that end generation (e.g. Qwen instruct: <|im_end|> and <|endoftext|>); eos_id first."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int: ...

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of a whole vocabulary entry (e.g. "<|im_end|>"), None if it is not one."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None: ...

    def special_tokens_map(self) -> dict[str, str]:
        """Names visible to the chat template (bos_token, eos_token, ...)."""
        return {}

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if self.chat_template is None:
            raise ValueError(f"{type(self).__name__} has no chat template (none found beside the tokenizer); "
                             "pass chat_template= to load_tokenizer")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    special_tokens=self.special_tokens_map(), **kwargs)

    def __len__(self) -> int:
        return self.vocab_size
