"""The KV blocks a request reserves, for one choice or n: the one formula of the router's and the worker's admission.

A request of ``n`` choices (samples) runs as ``n`` sequences on one worker. Choice 0 computes the prompt; the
others wait until its full prompt blocks are in the prefix cache and take them from there, so each of them
reserves its own blocks less those shared ones. Invariant: ``request_blocks(...) == sum(choice_blocks(...) for
each choice)``, and with ``n == 1`` it is ``ceil((prompt + max_tokens) / block_size)``, as before choices.
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def shared_prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a later choice takes from choice 0 through the prefix cache: ``(prompt - 1) // size``
    (a prefix hit always leaves one prompt token to compute, for its logits)."""
    return max(prompt_tokens - 1, 0) // block_size


def choice_blocks(prompt_tokens: int, max_tokens: int, block_size: int, index: int, shares_prompt: bool) -> int:
    """Blocks choice ``index`` reserves: all of prompt + ``max_tokens`` for choice 0 (or when choices do not
    share the prompt, i.e. without prefix caching), less the shared full prompt blocks for the others."""
    blocks = blocks_for(prompt_tokens + max_tokens, block_size)
    if index == 0 or not shares_prompt:
        return blocks
    return blocks - shared_prompt_blocks(prompt_tokens, block_size)


def request_blocks(prompt_tokens: int, max_tokens: int, n: int, block_size: int, shares_prompt: bool = True) -> int:
    """Blocks a request of ``n`` choices (0 counts as 1) reserves: the sum of its choices' ``choice_blocks``."""
    n = max(n, 1)
    first = choice_blocks(prompt_tokens, max_tokens, block_size, 0, shares_prompt)
    return first + (n - 1) * choice_blocks(prompt_tokens, max_tokens, block_size, 1, shares_prompt)
