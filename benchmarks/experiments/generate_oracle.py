"""Experiment (not a recorded benchmark): why does transformers' ``generate`` part from its own no-cache forward?

    python -m benchmarks.experiments.generate_oracle

Issue 25 saw ``generate`` (float32, CPU, the course's tiny Qwen2) give other tokens than repeated full forwards
for prompts of 257 tokens and more, and take it for a cache or mask path that changes at 256. Here the same prompt
lengths are decoded four ways: ``generate`` as the course's old oracle called it (``eos_token_id=None``,
``pad_token_id=0``), ``generate`` with the model's own eos, ``generate`` with an explicit all-ones attention mask,
and one full forward per new token (no cache). Each prompt is drawn at random from ids 1.. (no pad id), then the
same prompt with one id 0 (the tokenizer's ``<|endoftext|>``, which is also its pad token) in the middle.

Finding (transformers 5.19, torch 2.13, CPU, float32): no length threshold. ``generate`` agrees with the full
forward at every length tried, 100 to 2,049 tokens, while the prompt holds no pad id. With a pad id in the prompt
and ``eos_token_id=None``, ``GenerationMixin._prepare_attention_mask_for_generation`` infers an attention mask
``input_ids != pad_token_id`` (it does so when the pad id occurs in the input and differs from eos, and None
differs from everything), so that token is masked out of every query's view and the positions after it shift
(position ids come from the mask's cumulative sum): other tokens, at any length. Random prompts over a 512-token
vocabulary hold id 0 more and more often as they grow (1 - (511/512)^n: 39% at 257 tokens, 98% at 2,048), which is
how it looked like a length threshold. An engine, which has no pad tokens, must be checked against the full
forward (``lessonlib.serving.full_forward_greedy``), or against ``generate`` with an explicit attention mask.
"""

from __future__ import annotations

import random


import torch


def decode_four_ways(model, prompt: list[int], new_tokens: int = 4) -> dict[str, list[int]]:
    ids = torch.tensor([prompt])
    common = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        runs = {"generate(eos_token_id=None)": model.generate(ids, eos_token_id=None, **common),
                "generate(model's eos)": model.generate(ids, **common),
                "generate(attention_mask=ones)": model.generate(ids, attention_mask=torch.ones_like(ids),
                                                                eos_token_id=None, **common)}
        sequence = list(prompt)
        for _ in range(new_tokens):
            sequence.append(int(model(torch.tensor([sequence]), use_cache=False).logits[0, -1].argmax()))
    found = {name: out[0, len(prompt):].tolist() for name, out in runs.items()}
    found["full forward, no cache"] = sequence[len(prompt):]
    return found


def main() -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    from lessonlib import tiny_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model.build(), dtype=torch.float32).eval()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU float32, tiny Qwen2")
    rng = random.Random(0)
    for length in (100, 256, 257, 1025, 2049):
        prompt = [rng.randrange(1, model.config.vocab_size) for _ in range(length)]
        with_pad = prompt[:length // 2] + [0] + prompt[length // 2 + 1:]
        for label, ids in (("no pad id", prompt), ("pad id 0 inside", with_pad)):
            found = decode_four_ways(model, ids)
            truth = found["full forward, no cache"]
            parts = [f"{name}: {tokens}{'' if tokens == truth else '  <- differs'}" for name, tokens in found.items()]
            print(f"{length} tokens, {label}:\n    " + "\n    ".join(parts))


if __name__ == "__main__":
    main()
