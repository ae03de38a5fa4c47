"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

import torch

from services.worker.engine.request import SamplingOptions


class Sampler:
    """Turns the logits of the sampling rows into tokens.

    Greedy rows take the first argmax (as transformers' ``generate``). Other rows are filtered and
    drawn one by one, each from its request's own generator when it has a seed (so a seeded request
    draws the same numbers alone or in any batch), else from the sampler's shared generator.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        options: list[SamplingOptions],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """One token per row of ``logits [N, vocab]``; ``options`` and ``generators`` are per row."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        for row, (opts, generator) in enumerate(zip(options, generators, strict=True)):
            if opts.temperature > 0:
                probs = filtered_probs(logits[row], opts)
                draw = torch.multinomial(probs.cpu(), 1, generator=generator or self.generator)
                tokens[row] = int(draw)
        return tokens


def filtered_probs(logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """Probabilities of one row ``[vocab]`` after temperature, top-k then top-p."""
    scaled = logits / opts.temperature
    if 0 < opts.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, opts.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0 < opts.top_p < 1:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop = before >= opts.top_p  # keep the smallest set holding top_p of the mass
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1)
