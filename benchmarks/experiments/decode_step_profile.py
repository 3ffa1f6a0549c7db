"""Experiment (not a recorded benchmark): where the batch-1 decode step's time goes, kernel by kernel.

    python -m benchmarks.experiments.decode_step_profile [--out FILE]

bench_engine.py records the fused batch-1 step's GPU time against its bytes-read limit (0.677 on the Llama-3.2-1B
shape, 0.369 on Qwen2.5-0.5B's); this says which kernels hold the rest. One engine per shape
(``Features(fused_decode_layer=True)``, random weights, bench_engine.py's context: prompt 128 + 64 new tokens), its
step captured in one CUDA graph (as bench_engine.py times it) and replayed under torch.profiler, the L2 flushed before
each replay. For each kernel of the median replay: its name, its start relative to the step's first kernel, its
duration and its advance (how far the step's end moved on while it ran: a kernel launched early under programmatic
dependent launch overlaps the one before); then per role in the layer (the n-th kernel of every layer), the median
and the sum over the layers; and the step's span against its kernels' busy time (the gaps between them).
Each shape is profiled twice: paged attention with its own split count, and with one split (``decode_splits=1``:
no reduce kernel's work spread, the split kernel reads the whole context per KV head). GPU only.
"""

from __future__ import annotations

import statistics
from pathlib import Path


import torch

from lessonlib.cases import engine_models
from benchmarks.experiments import gpu_experiment
from lessonlib import runtime
from lessonlib.engine import LLM, Features, ModelConfig
from lessonlib.measure import time_graph

CONTEXT = 128 + 128 // 2  # bench_engine.py's batch-1 step
SHAPES = {"Llama-3.2-1B": (engine_models.LLAMA_1B, "Llama"), "Qwen2.5-0.5B": (engine_models.QWEN_05B, "Qwen2")}
REPLAYS = 20


def profile_step(step, flush) -> list[list[dict]]:
    """Each replay's kernels (name, start, end in us), the flush's fill kernels left out."""
    from torch.profiler import ProfilerActivity, profile

    from lessonlib.cuda_graphs import Graphed

    graphed = Graphed(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as probe:  # the flush's own kernels, by name
        flush.zero_()
        torch.cuda.synchronize()
    flushes = {e.name for e in probe.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            flush.zero_()
            graphed.graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[1])
    replays, current = [], []
    for name, start, end in kernels:
        if name in flushes:  # a replay follows
            if current:
                replays.append(current)
            current = []
            continue
        current.append({"name": name, "start": start, "end": end})
    if current:
        replays.append(current)
    return replays


def summarize(replay: list[dict], layers: int) -> dict:
    t0 = replay[0]["start"]
    span = max(k["end"] for k in replay) - t0
    busy = sum(k["end"] - k["start"] for k in replay)
    union, last_end = 0.0, t0
    for k in replay:
        start, end = max(k["start"], last_end), k["end"]
        if end > start:
            union += end - start
        last_end = max(last_end, end)
    count = len(replay)
    names = [k["name"] for k in replay]
    ends = [replay[0]["start"]] + [max(k["end"] for k in replay[:i + 1]) for i in range(count)]
    for i, k in enumerate(replay):  # how far the step's end moved on while this kernel ran (PDL overlaps kernels)
        k["advance"] = max(0.0, k["end"] - ends[i])
    per_layer, first, roles = None, None, []
    for period in range(count // layers, 0, -1):  # the layer's kernel count: every layer the same names
        first = next((i for i in range(count - layers * period + 1)
                      if names[i:i + (layers - 1) * period] == names[i + period:i + layers * period]), None)
        if first is not None:
            per_layer = period
            break
    if per_layer and first is not None:
        for j in range(per_layer):
            members = [replay[first + layer * per_layer + j] for layer in range(layers)]
            roles.append({"role": j, "name": members[0]["name"],
                          "us_per_layer": round(statistics.median(m["end"] - m["start"] for m in members), 2),
                          "us_all_layers": round(sum(m["end"] - m["start"] for m in members), 1),
                          "advance_us_per_layer": round(statistics.median(m["advance"] for m in members), 2),
                          "advance_us_all_layers": round(sum(m["advance"] for m in members), 1)})
        outside = replay[:first] + replay[first + layers * per_layer:]
    else:
        outside = []
    return {"kernels": count, "kernels_per_layer": per_layer, "span_us": round(span, 1),
            "sum_of_kernels_us": round(busy, 1), "busy_us": round(union, 1), "idle_us": round(span - union, 1),
            "roles": roles,
            "outside_layers": [{"name": k["name"], "us": round(k["end"] - k["start"], 2),
                                "advance_us": round(k["advance"], 2)} for k in outside],
            "sequence": [{"name": k["name"], "start_us": round(k["start"] - t0, 2),
                          "us": round(k["end"] - k["start"], 2), "advance_us": round(k["advance"], 2)}
                         for k in replay]}


def profile_shape(name: str, path: Path, dtype: torch.dtype, bandwidth: float, flush: torch.Tensor) -> list[dict]:
    """One engine's step, profiled with paged_attention's own split count and with one split."""
    config = ModelConfig.from_folder(path)
    element = torch.empty((), dtype=dtype).element_size()
    step_bytes = (config.weight_bytes(element)
                  + 2 * CONTEXT * config.num_layers * config.num_kv_heads * config.head_dim * element)
    limit_us = step_bytes / bandwidth * 1e6
    llm = LLM(path, dtype=dtype, max_num_seqs=1, max_model_len=CONTEXT + 16, features=Features(fused_decode_layer=True))
    model, k, v = llm.model, llm.runner.k_caches, llm.runner.v_caches
    rows = []
    for splits in (None, 1):
        with engine_models.decode_inputs(llm, 1, CONTEXT) as (ctx, ids, positions), torch.inference_mode():
            ctx.decode_splits = splits
            step = lambda: model.logits(model(ids, positions, ctx, k, v))  # noqa: E731
            us = time_graph(step).median_us
            replays = profile_step(step, flush)
        spans = [r[-1]["end"] - r[0]["start"] for r in replays]
        median = replays[spans.index(sorted(spans)[len(spans) // 2])]
        row = {"shape": name, "decode_splits": splits or "paged_attention's choice", "gpu_us": round(us, 1),
               "limit_us": round(limit_us, 1), "fraction_of_limit": round(limit_us / us, 3),
               "replays_profiled": len(replays), **summarize(median, config.num_layers)}
        rows.append(row)
        print(f"{name} splits={splits}: {us:.1f} us (limit {limit_us:.1f}, {limit_us / us:.3f}); profiled "
              f"span {row['span_us']} us, {row['kernels']} kernels, busy {row['busy_us']}, idle "
              f"{row['idle_us']}", flush=True)
        for role in row["roles"]:
            print(f"   role {role['role']}: {role['us_per_layer']:7.2f} us/layer (advance "
                  f"{role['advance_us_per_layer']:6.2f}), all layers {role['us_all_layers']:8.1f} us (advance "
                  f"{role['advance_us_all_layers']:7.1f})  {role['name'][:80]}", flush=True)
        for other in row["outside_layers"]:
            print(f"   outside: {other['us']:7.2f} us (advance {other['advance_us']:6.2f})  "
                  f"{other['name'][:80]}", flush=True)
    return rows


def main():
    args, bandwidth = gpu_experiment.start(__doc__.split("\n\n")[0],
                                           "decode_step_profile.py profiles CUDA graphs: it needs a GPU")
    dtype = runtime.dtype()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    rows = []
    for name, path in engine_models.each_checkpoint(SHAPES, dtype, "decode-step-profile-"):
        rows += profile_shape(name, path, dtype, bandwidth, flush)
    gpu_experiment.write_results(args.out, "python -m benchmarks.experiments.decode_step_profile", bandwidth, rows,
                                 context=CONTEXT)


if __name__ == "__main__":
    main()
