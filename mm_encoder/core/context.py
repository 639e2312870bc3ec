"""The context-length rule, one place for every process that applies it (the frontend, both
engines, Dynamo's preprocessed requests): a prompt must leave room for at least one token, and a
prompt plus its completion budget must fit."""

from __future__ import annotations

from .errors import ContextOverflow


def room(prompt_tokens: int, context_length: int, limit: str = "the model's context length") -> int:
    """How many tokens a completion may have after the prompt; a prompt that leaves none is refused."""
    left = context_length - prompt_tokens
    if left < 1:
        raise ContextOverflow(f"the prompt is {prompt_tokens} tokens after expanding its media; {limit} is "
                              f"{context_length}")
    return left


def check_fits(prompt_tokens: int, max_tokens: int, context_length: int, limit: str = "the context length") -> None:
    """A request whose prompt plus completion budget would pass the context is refused before any work."""
    if prompt_tokens + max_tokens > context_length:
        raise ContextOverflow(f"prompt {prompt_tokens} + max_tokens {max_tokens} exceeds {limit} {context_length}")
