"""Experiment (not a recorded benchmark): decode_gemv's tiles in the engine's whole batch-1 decode step.

    python -m benchmarks.experiments.decode_step_tiles [--rounds 3] [--out FILE]

decode_gemv_tiles.py found qkv and gate_up faster together at (4, 2048, 4) than at ``decode_gemv.GPU_TILES``, in the
projections alone (7.6% on the Llama-3.2-1B shape, none on Qwen2.5-0.5B's); bench_engine.py's batch-1 step, run
separately with those tiles, showed no gain, but against another run's record. Here GPU_TILES and the two winners
(together, and each alone) are timed in one run, on one engine per shape (``Features(fused_decode_layer=True)``,
random weights), as bench_engine.py times its batch-1 step record: the whole step (embedding, every layer, the output
head) captured in one CUDA graph and replayed (GPU time), at bench_engine's context (prompt 128 + 64 new tokens),
rounds interleaved (each table once per round) so that their spread is the run's noise, beside the step's bytes-read
limit at the same run's copy bandwidth. GPU only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path


import torch

from lessonlib.cases import engine_models
from benchmarks.experiments.decode_gemv_tiles import TOGETHER, with_table
from lessonlib import runtime
from lessonlib.engine import LLM, Features, ModelConfig
from lessonlib.measure import measure_ceilings, time_graph, warm_up_gpu
from lessonlib.results import environment

decode_gemv = importlib.import_module("lessonlib.ops.decode_gemv")
CONTEXT = 128 + 128 // 2  # bench_engine.py's batch-1 step: the middle of a 128-token prompt's 128 new tokens
# decode_gemv.GPU_TILES when this experiment was run (session 18), the base of every table below, so that a rerun
# times what the results file holds; the fifth table below is the one adopted as GPU_TILES since.
GPU_TILES = {decode_gemv.STORE: (4, 2048, 4), decode_gemv.RESIDUAL: (4, 2048, 4), decode_gemv.SWIGLU: (8, 1024, 4),
             decode_gemv.ROPE_KV: (2, 2048, 4)}
GATE_UP = {decode_gemv.SWIGLU: TOGETHER[decode_gemv.SWIGLU]}
# Each table: GPU_TILES with these epilogues' tiles changed (decode_gemv_tiles' two winners, together and alone), and
# with BLOCK_N widened where K is narrower than BLOCK_K, for these epilogues ("same bytes": each program reads as many
# bytes as at a K of BLOCK_K or more).
VARIANTS = {"GPU_TILES": ({}, ()), "qkv and gate_up (4, 2048, 4)": (TOGETHER, ()),
            "qkv (4, 2048, 4)": ({decode_gemv.ROPE_KV: TOGETHER[decode_gemv.ROPE_KV]}, ()),
            "gate_up (4, 2048, 4)": (GATE_UP, ()),
            "gate_up (4, 2048, 4); same bytes: qkv": (GATE_UP, (decode_gemv.ROPE_KV,)),
            "gate_up (4, 2048, 4); same bytes: all": (GATE_UP, tuple(GPU_TILES))}
EPILOGUES = {decode_gemv.STORE: "store", decode_gemv.RESIDUAL: "o and down (+ residual)",
             decode_gemv.SWIGLU: "gate_up (+ norm, SwiGLU)", decode_gemv.ROPE_KV: "qkv (+ norm, RoPE, KV store)"}
SHAPES = {"Llama-3.2-1B": (engine_models.LLAMA_1B, "Llama"), "Qwen2.5-0.5B": (engine_models.QWEN_05B, "Qwen2")}


def same_bytes(table, epilogues):
    """decode_gemv.config with ``table`` in place of decode_gemv.GPU_TILES, and BLOCK_N widened for ``epilogues``
    where BLOCK_K was cut to K's power of two: each program reads as many bytes as the table's tile."""
    config = with_table(table)

    def widened(n_out, k, which):
        meta = config(n_out, k, which)
        if which in epilogues:
            meta = {**meta, "BLOCK_N": meta["BLOCK_N"] * max(1, table[which][1] // meta["BLOCK_K"])}
        return meta
    return widened


def step_us(llm: LLM) -> float:
    """GPU time of one batch-1 decode step, its CUDA graph replayed (bench_engine.batch_1_decode_step's timing)."""
    with engine_models.decode_inputs(llm, 1, CONTEXT) as (ctx, ids, positions), torch.inference_mode():
        model, k, v = llm.model, llm.runner.k_caches, llm.runner.v_caches
        return time_graph(lambda: model.logits(model(ids, positions, ctx, k, v))).median_us


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not runtime.on_gpu():
        sys.exit("decode_step_tiles.py times CUDA graphs: it needs a GPU")
    dtype = runtime.dtype()
    warm_up_gpu()
    bandwidth = measure_ceilings().bandwidth_gbs * 1e9
    tables = {label: same_bytes({**GPU_TILES, **changes}, widened)
              for label, (changes, widened) in VARIANTS.items()}
    rows, default = [], decode_gemv.config
    folder = Path(tempfile.mkdtemp(prefix="decode-step-tiles-", dir=runtime.scratch_dir()))
    try:
        for name, (shape, family) in SHAPES.items():
            path = engine_models.build_checkpoint(folder / name, shape, dtype, family)
            config = ModelConfig.from_folder(path)
            element = torch.empty((), dtype=dtype).element_size()
            step_bytes = (config.weight_bytes(element)
                          + 2 * CONTEXT * config.num_layers * config.num_kv_heads * config.head_dim * element)
            limit_us = step_bytes / bandwidth * 1e6
            llm = LLM(path, dtype=dtype, max_num_seqs=1, max_model_len=CONTEXT + 16,
                      features=Features(fused_decode_layer=True))
            for round_ in range(args.rounds):
                for label, table in tables.items():
                    decode_gemv.config = table
                    us = step_us(llm)
                    rows.append({"shape": name, "tiles": label, "round": round_ + 1, "gpu_us": round(us, 2),
                                 "limit_us": round(limit_us, 2), "fraction_of_limit": round(limit_us / us, 3)})
                    print(f"{name:14s} {label:38s} round {round_ + 1}: {us:8.2f} us, limit {limit_us:7.2f} us "
                          f"({limit_us / us:.3f})", flush=True)
            decode_gemv.config = default
            del llm
            torch.cuda.empty_cache()
            shutil.rmtree(folder / name, ignore_errors=True)
    finally:
        decode_gemv.config = default
        shutil.rmtree(folder, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python -m benchmarks.experiments.decode_step_tiles --rounds " + str(args.rounds),
            "environment": environment(), "bandwidth_gbs": round(bandwidth / 1e9, 1), "context": CONTEXT,
            "tiles": "(BLOCK_N, BLOCK_K, num_warps) per epilogue; BLOCK_K no wider than K rounded up to a power of 2",
            "GPU_TILES": {EPILOGUES[k]: v for k, v in GPU_TILES.items()},
            "variants": {label: {"tiles": {EPILOGUES[k]: v for k, v in changes.items()},
                                 "same_bytes": [EPILOGUES[k] for k in widened]}
                         for label, (changes, widened) in VARIANTS.items()},
            "results": rows}, indent=1))


if __name__ == "__main__":
    main()
