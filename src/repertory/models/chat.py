"""The one chat-template render: what a policy samples from, and what logged text turns become."""

from __future__ import annotations

from typing import Any

from repertory.types import Message, chat_dicts


def chat_prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """A chat rendered with the tokenizer's chat template, ready for the assistant turn (what a policy samples
    from, and what logged turns are rendered to)."""
    encoded = tokenizer.apply_chat_template(chat_dicts(messages), add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def render_logged(tokenizer: Any, messages: list[Message], response: str) -> tuple[list[int], list[int]]:
    """Prompt ids as the policy samples them (chat template, generation prompt) and the response ids
    closed by the end-of-turn token, as a sampled response ends."""
    prompt = chat_prompt_ids(tokenizer, messages)
    response_ids = tokenizer.encode(response, add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    return prompt, response_ids + ([end] if end is not None else [tokenizer.eos_token_id])
