"""From logits to the next token: greedy, temperature, top-p (nucleus) sampling, reproducible with a seed."""

from __future__ import annotations

import torch


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, in each row, the smallest set of most likely tokens whose probabilities sum to at least ``top_p``
    (ties at the boundary are kept), zero the rest, renormalise. probs: (B, V) float32; top_p: (B,).

    A token is kept when the probability mass of the tokens strictly more likely than it is below top_p: the most
    likely token is always kept, and the set stops at the first token that brings the sum to top_p or beyond.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    keep_sorted = mass_before < top_p[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


class Sampler:
    """Samples one token per row. Each request draws from its own generator, seeded with its SamplingParams.seed,
    so a request's tokens do not depend on which other requests share its batch."""

    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def start(self, seq_id: int, seed: int | None) -> None:
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        self._generators[seq_id] = generator

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seq_ids: list[int], temperatures: list[float],
                 top_ps: list[float], greedy: torch.Tensor | None = None) -> torch.Tensor:
        """logits: (B, V) float32; greedy: (B,) each row's argmax if the step computed it already (the engine's
        runner does, on the GPU). Returns the B token ids as a (B,) int64 tensor on the logits' device: a greedy
        batch is sampled without the host waiting for the GPU."""
        tokens = logits.argmax(dim=-1) if greedy is None else greedy
        sampled = [i for i, t in enumerate(temperatures) if t > 0]
        if sampled:  # sampled rows overwrite their greedy token (in a copy: greedy may be a graph's output)
            tokens = tokens.clone()
            rows = torch.tensor(sampled, device=logits.device)
            temperature = torch.tensor([temperatures[i] for i in sampled], device=logits.device)
            top_p = torch.tensor([top_ps[i] for i in sampled], device=logits.device)
            probs = torch.softmax(logits[rows] / temperature[:, None], dim=-1)
            probs = top_p_filter(probs, top_p)
            for row, i in enumerate(sampled):
                tokens[i] = torch.multinomial(probs[row], 1, generator=self._generators[seq_ids[i]])[0]
        return tokens
