"""Whether a request can ever run: the one rule, checked at the edge (the frontend refuses it with a 400 before
admission) and again by the scheduler, which must never take a request it cannot finish whoever sent it."""

from __future__ import annotations


def request_fit_error(num_prompt_tokens: int, max_new_tokens: int, context_length: int, max_total_tokens: int) -> str:
    """Why a request of this size can never run ("" when it can, perhaps after waiting): prompt and output must fit
    the context length and the KV cache."""
    if num_prompt_tokens == 0:
        return "empty prompt: at least one input token is needed"
    if max_new_tokens < 0:
        return f"max_new_tokens must be >= 0, got {max_new_tokens}"
    total = num_prompt_tokens + max_new_tokens
    size = f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} tokens"
    if total > context_length:
        return f"{size} exceeds the context length ({context_length})"
    if total > max_total_tokens:
        return f"{size} exceeds the KV cache capacity ({max_total_tokens} tokens)"
    return ""
