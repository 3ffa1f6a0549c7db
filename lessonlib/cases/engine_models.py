"""The engine's model shapes and the checkpoints the benchmarks and experiments build from them: a random-weight
Llama-3.2-1B and Qwen2.5-0.5B (their real shapes; nothing downloaded) and a tiny model for smoke runs, written as
Hugging Face checkpoints the engine loads; and a decode step's inputs at a chosen batch and context.

    from lessonlib.cases.engine_models import LLAMA_1B, build_checkpoint
    path = build_checkpoint(folder, LLAMA_1B, torch.bfloat16)
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from lessonlib import runtime
from lessonlib.engine import LLM, SamplingParams
from lessonlib.engine.model import StepContext
from lessonlib.engine.sequence import Sequence

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, tie_word_embeddings=True)


def build_checkpoint(folder: Path, shape: dict, dtype: torch.dtype, family: str = "Llama") -> Path:
    """A random-weight Llama (or ``family="Qwen2"``) written as a Hugging Face checkpoint (config.json +
    safetensors; no tokenizer)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**{"max_position_embeddings": 2048, **shape}, bos_token_id=None,
                                                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(runtime.device()):  # random init on the GPU: seconds instead of a minute on the CPU
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    del model
    return folder


def each_checkpoint(shapes: dict, dtype: torch.dtype, prefix: str):
    """Yields (name, path) for each of ``shapes`` ({name: (shape, family)}): a :func:`build_checkpoint` in a scratch
    folder, deleted (and the GPU's cached memory freed) before the next is written: an experiment's one engine per
    shape."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=runtime.scratch_dir()))
    try:
        for name, (shape, family) in shapes.items():
            yield name, build_checkpoint(folder / name, shape, dtype, family)
            if runtime.on_gpu():
                torch.cuda.empty_cache()
            shutil.rmtree(folder / name, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def decode_inputs(llm: LLM, batch: int, context: int):
    """(ctx, ids, positions) of a decode step at this batch and context: sequences of random tokens allocated in
    the engine's block manager (freed after). K/V content does not matter for time: the blocks are allocated, not
    filled. Random tokens: sequences must not share prefix blocks (a shared block would be read from L2, not HBM)."""
    model, runner = llm.model, llm.runner
    seqs = [Sequence(torch.randint(0, model.config.vocab_size, (context,)).tolist(), SamplingParams())
            for _ in range(batch)]
    for seq in seqs:
        llm.block_manager.allocate(seq)
    try:
        bs, device = llm.block_size, runner.device
        slots = torch.tensor([seq.block_table[(context - 1) // bs] * bs + (context - 1) % bs for seq in seqs],
                             device=device)
        table = runner._table(seqs, width=runner.max_blocks)
        ctx = StepContext(False, slots, table, torch.full((batch,), context, dtype=torch.int32, device=device),
                          decode_splits=None if runtime.on_gpu() else 1)
        positions = torch.full((batch,), context - 1, device=device)
        yield ctx, torch.randint(0, model.config.vocab_size, (batch,), device=device), positions
    finally:
        for seq in seqs:
            llm.block_manager.free(seq)
        llm.block_manager.forget_prefix_cache()  # those blocks were registered but never filled
