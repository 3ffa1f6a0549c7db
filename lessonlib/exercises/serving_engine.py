"""Lesson 07's checkers (notebook 07_serving_engine): the scheduler's admission test, chunked prefill's token-budget
split and top-p filtering.
"""

from __future__ import annotations

import torch

from lessonlib.exercises._checking import ExerciseFailed, passed


def check_can_admit(fn) -> None:
    """``fn(prompt_blocks, cached_idle_blocks, cached_busy_blocks, free_blocks, running, max_num_seqs, new_tokens,
    batched_tokens, max_batched_tokens) -> bool``: the engine's admission rule (``lessonlib.engine.can_admit``),
    checked against it on the edge cases and on random situations."""
    import random

    from lessonlib.engine import can_admit

    base = dict(prompt_blocks=4, cached_idle_blocks=0, cached_busy_blocks=0, free_blocks=4, running=0,
                max_num_seqs=2, new_tokens=64, batched_tokens=0, max_batched_tokens=100)
    hints = [
        ({}, "a prompt whose blocks are all free fits"),
        ({"free_blocks": 3}, "one block short: it must wait"),
        ({"free_blocks": 2, "cached_busy_blocks": 2}, "blocks another sequence holds are shared: they cost no free block"),
        ({"free_blocks": 2, "cached_idle_blocks": 2}, "a cached block in the free list still leaves the free list when reused"),
        ({"running": 2}, "the batch is full (max_num_seqs)"),
        ({"batched_tokens": 50}, "this step's token budget would overflow"),
        ({"new_tokens": 500}, "a lone prompt always fits the token budget (else it could never run)"),
    ]
    rng = random.Random()
    for _ in range(200):
        blocks = rng.randrange(1, 9)
        idle = rng.randrange(0, blocks + 1)
        busy = rng.randrange(0, blocks - idle + 1)
        hints.append(({"prompt_blocks": blocks, "cached_idle_blocks": idle, "cached_busy_blocks": busy,
                       "free_blocks": rng.randrange(0, 9), "running": rng.randrange(0, 3),
                       "new_tokens": rng.randrange(1, 120), "batched_tokens": rng.choice([0, rng.randrange(1, 100)])},
                      "a random situation"))
    for change, hint in hints:
        args = {**base, **change}
        try:
            got = fn(**args)
        except NotImplementedError as e:
            raise ExerciseFailed(f"can_admit: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        want = can_admit(**args)
        if bool(got) != want:
            raise ExerciseFailed(f"can_admit{args} returned {got}, expected {want}: {hint}")
    passed(f"✓ can_admit agrees with the engine's rule on {len(hints)} situations")


def check_top_p_filter(fn) -> None:
    """``fn(probs, top_p) -> probs``: keep in each row the smallest set of most likely tokens whose probabilities sum
    to at least top_p, zero the rest and renormalise (``lessonlib.engine.top_p_filter``)."""
    from lessonlib.engine import top_p_filter

    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    cases = [(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([0.5]), "exactly 0.5 is reached by the top token alone"),
             (torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([0.6]), "0.5 < 0.6: the second token is needed too"),
             (torch.tensor([[0.2, 0.5, 0.3]]), torch.tensor([1.0]), "top_p = 1 keeps everything"),
             (torch.tensor([[0.1, 0.7, 0.2]]), torch.tensor([1e-9]), "a tiny top_p keeps the most likely token only")]
    for _ in range(5):
        vocab = int(torch.randint(1, 40, (), generator=generator))
        probs = torch.softmax(3 * torch.randn(4, vocab, generator=generator), dim=-1)
        cases.append((probs, torch.rand(4, generator=generator).clamp_min(1e-3), "random rows"))
    for probs, top_p, hint in cases:
        try:
            got = fn(probs.clone(), top_p.clone())
        except NotImplementedError as e:
            raise ExerciseFailed(f"top_p_filter: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        want = top_p_filter(probs, top_p)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise ExerciseFailed(f"top_p_filter returned {type(got).__name__} {getattr(got, 'shape', '')}; expected a "
                                 f"tensor of shape {tuple(want.shape)}")
        if not torch.allclose(got, want, atol=1e-6):
            raise ExerciseFailed(f"top_p_filter({probs.tolist()[0][:5]}..., top_p={top_p.tolist()[0]:.3g}) gave "
                                 f"{got.tolist()[0][:5]}..., expected {want.tolist()[0][:5]}...: {hint}")
    passed(f"✓ top_p_filter keeps the nucleus and renormalises ({len(cases)} cases)")


def check_prompt_chunks(fn) -> None:
    """``fn(num_decodes, prompt_tokens_left, max_num_batched_tokens) -> list[int]``: the token-budget split of a
    chunked-prefill step (``lessonlib.engine.prompt_chunks``): each running decode takes one token first, then each
    prompt in order takes as many of its tokens left as the budget still holds. Checked on the cases that tell the
    likely mistakes apart, then on random steps."""
    import numbers
    import random

    from lessonlib.engine import prompt_chunks

    hints = [
        ((0, [100], 16), "a prompt longer than the budget gets the whole budget: the rest waits for later steps"),
        ((0, [5], 16), "a prompt never takes more than its tokens left"),
        ((4, [100], 16), "the running decodes take one token each first"),
        ((0, [10, 10], 16), "prompts share one budget: each takes what the ones before it left"),
        ((3, [7, 20, 4], 12), "in arrival order: the prompt in progress first"),
        ((16, [30, 2], 16), "the decodes took the whole budget: no prompt runs this step (never a negative chunk)"),
        ((2, [], 8), "no prompt waiting: an empty split"),
    ]
    rng = random.Random()
    for _ in range(300):
        budget = rng.randrange(1, 65)
        hints.append(((rng.randrange(0, budget + 1), [rng.randrange(1, 80) for _ in range(rng.randrange(0, 5))],
                       budget), "a random step"))
    for (decodes, left, budget), hint in hints:
        try:
            got = fn(decodes, list(left), budget)
        except NotImplementedError as e:
            raise ExerciseFailed(f"prompt_chunks: not implemented yet ({str(e) or 'NotImplementedError'}). "
                                 "Fill in the stub.") from None
        want = prompt_chunks(decodes, left, budget)
        call = f"prompt_chunks({decodes}, {left}, {budget})"
        if not isinstance(got, (list, tuple)) or not all(isinstance(c, numbers.Integral) for c in got):
            raise ExerciseFailed(f"{call} returned {got!r}, expected the list {want}: return a list of ints, one per "
                                 "prompt")
        if len(got) != len(want):
            raise ExerciseFailed(f"{call} returned {len(got)} chunks for {len(left)} prompts ({list(got)}, expected "
                                 f"{want}): one chunk per prompt, in order, 0 for each prompt the budget does not "
                                 "reach")
        if list(got) != want:
            raise ExerciseFailed(f"{call} returned {list(got)}, expected {want}: {hint}")
    passed(f"✓ prompt_chunks splits the budget as the engine does on {len(hints)} steps")
