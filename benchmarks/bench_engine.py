"""Lesson 07's benchmark: the course's serving engine against Hugging Face transformers' ``generate``.

    python -m benchmarks.bench_engine --out lessonlib/results/engine-h200.json

A random-weight Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 query / 8 KV heads, head_dim 64, MLP 8192,
vocabulary 128256, tied embeddings; built here with transformers' LlamaConfig, nothing downloaded), bf16, saved as a
local checkpoint the engine loads. 128-token random prompts, 128 new tokens (greedy, no early stop), batch 1, 8, 32.
Peers in the same run: transformers ``generate`` with its default dynamic cache (eager), and with its static cache
(``cache_implementation="static"``, which compiles the forward; warmed up at the timed shapes first), and the
engine with and without CUDA graphs (``Features(cuda_graphs=False)``, which keeps asynchronous scheduling), the engine with
CUDA graphs but the host waiting for each step's tokens before scheduling the next
(``Features(async_scheduling=False)``), and at batch 1 the engine with CUDA graphs but cuBLAS for its projections
(``Features(gemv=False)``: what ``ops.gemv`` and its programmatic dependent launch give) and with its batch-1 decode
layer in six kernels (``Features(fused_decode_layer=True)``: ops.decode_gemv). For that switch, the batch-1 decode
step off and on: kernels per layer (counted with torch.profiler on one layer's call) and the step's GPU time (its
CUDA graph replayed) beside the bytes-read limit at the same run's copy bandwidth.

``--qwen-shape``: a Qwen2.5-0.5B-shaped model instead (hidden 896, 24 layers, 14 query / 2 KV heads, head_dim 64,
MLP 4864, vocabulary 151936, tied embeddings, biases on q, k, v; transformers' Qwen2Config), the same checks and
timings, no ladder (lesson 07's ladder is the Llama's):

    python -m benchmarks.bench_engine --qwen-shape --out lessonlib/results/engine-qwen-h200.json

``--no-ladder`` leaves the ladder out of a Llama run (the rest takes minutes, not the ladder's five more).

Checks first: the engine's logits at the prefill and the first decode steps against transformers in float64 (the
truth), allowed 2x the error of transformers in bf16 plus two bf16 roundings (lessonlib.testing's rule), and greedy
tokens against transformers bf16 up to the first near-tie. Then tokens/s, and one decode step's time split into
its parts (attention, MLP, norms, output head, sampling, each replayed from a CUDA graph; host = what the engine's
step takes beyond the graph's GPU time, i.e. the GPU idle while the host works) against the step's bytes-read limit
(weights + K/V at the copy bandwidth).
Then the tokens/s ladder (lesson 07): the engine with each course step switched on in turn (plain PyTorch, + fused
ops, + FlashAttention prefill, + paged decode, + CUDA graphs with asynchronous scheduling, + continuous batching;
lessonlib.cases.serving_engine.ladder), on a workload where batching policy matters: 64 requests for 32 seats, 128-token
prompts, each request's max_tokens drawn from 16..256 (seeded), no early stop. Every rung serves the same requests,
LADDER_REPEATS times on the same engine: tokens/s = output tokens / wall time, the median run's, with the slowest
and fastest beside it; then once more under torch.profiler for the GPU's kernel time per step (which the host's
noise does not move: lessonlib.measure.gpu_busy_seconds).
``--ladder-only`` runs the ladder alone (about 5 minutes on an H200) and puts its records into the ``--out`` file in
place of the ladder's there, every other record kept; the ladder's own command and versions go in its notes:

    python -m benchmarks.bench_engine --ladder-only --out lessonlib/results/engine-h200.json

``--smoke`` runs a tiny model in any mode (CPU: interpreter, float32, no graphs, no static cache, no breakdown; a
ladder of 3 requests for 2 seats, run twice).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path


import torch

from lessonlib import bench, ops, runtime
from lessonlib.engine import LLM, Features, ModelConfig, SamplingParams
from lessonlib.cases.engine_models import LLAMA_1B, QWEN_05B, TINY, build_checkpoint, decode_inputs
from lessonlib.cases.serving_engine import run_ladder
from lessonlib.ops._common import pdl
from lessonlib.measure import measure_ceilings, time_graph, warm_up_gpu
from lessonlib.results import Benchmark, Impl, Op, Results, environment, load
from lessonlib.serving.greedy_parity import first_difference, near_tie_gap
from lessonlib.testing import tolerance

CHECK_STEPS = 4  # logits compared at the prefill and the next CHECK_STEPS - 1 decode steps
LADDER_REPEATS = 3  # timed runs per rung: a median and its spread, no verdict on one run


def hf_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(runtime.device()).eval()


def random_prompts(batch: int, length: int, vocab: int, generator: torch.Generator) -> list[list[int]]:
    return torch.randint(0, vocab, (batch, length), generator=generator).tolist()


def sync():
    if runtime.on_gpu():
        torch.cuda.synchronize()


def hf_generate(model, prompts, new_tokens: int, static: bool = False) -> tuple[list[list[int]], float]:
    """Greedy continuations from transformers and the wall time of the call (exactly new_tokens each)."""
    ids = torch.tensor(prompts, device=runtime.device())
    extra = {"cache_implementation": "static"} if static else {}
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **extra)
    sync()
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - start


def engine_generate(llm: LLM, prompts, new_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def check_logits(llm: LLM, truth_model, low_model, prompts, steps: int) -> dict:
    """The engine's logits at the prefill and the next decode steps, teacher-forced along its own greedy tokens,
    against transformers in float64 (truth) and in the engine's dtype (what an honest low-precision run gets)."""
    captured = []
    prefill, decode = llm.runner.prefill, llm.runner.decode

    def recording(run):
        def wrapped(seqs, *args):
            out = run(seqs, *args)
            captured.append(out.logits.float().clone())
            return out
        return wrapped

    llm.runner.prefill, llm.runner.decode = recording(prefill), recording(decode)
    try:
        tokens, _ = engine_generate(llm, prompts, steps)
    finally:
        llm.runner.prefill, llm.runner.decode = prefill, decode
    full = torch.tensor([p + t for p, t in zip(prompts, tokens)], device=runtime.device())
    positions = slice(len(prompts[0]) - 1, len(prompts[0]) - 1 + steps)
    with torch.inference_mode():
        truth = truth_model(full).logits[:, positions].double()
        low = low_model(full).logits[:, positions].float()
    report = {"steps": steps, "batch": len(prompts), "per_step": []}
    for step, ours in enumerate(captured):
        t, lo = truth[:, step], low[:, step]
        error = (ours.double() - t).abs().max().item()
        allowed = tolerance(t, lo, llm.dtype)
        report["per_step"].append({"step": step, "max_error": error, "allowed": allowed,
                                   "transformers_bf16_error": (lo.double() - t).abs().max().item(),
                                   "passed": error <= allowed})
    report["passed"] = all(s["passed"] for s in report["per_step"])
    return report


def first_divergence(ours, theirs, prompts, truth_model, low_model, dtype) -> dict:
    """Where the engine's greedy tokens first differ from transformers' (per prompt; both run to the same length),
    and whether that is a near-tie (lessonlib.serving.greedy_parity.near_tie_gap, as lesson 07's live ladder
    judges it)."""
    report = {"identical": 0, "diverged": []}
    for prompt, a, b in zip(prompts, ours, theirs):
        i = first_difference(a, b)
        if i is None:
            report["identical"] += 1
            continue
        ids = torch.tensor([prompt + a[:i]], device=runtime.device())
        with torch.inference_mode():
            truth, low = truth_model(ids).logits[0, -1], low_model(ids).logits[0, -1]
        gap, allowed = near_tie_gap(truth, low, a[i], b[i], dtype)
        report["diverged"].append({"at_token": i, "logit_gap_fp64": gap, "allowed": allowed,
                                   "near_tie": gap <= allowed})
    report["all_divergences_near_ties"] = all(d["near_tie"] for d in report["diverged"])
    return report


def step_breakdown(llm: LLM, batch: int, context: int) -> dict[str, float]:
    """GPU time (us) of each part of one decode step at this batch and context, each part over every layer
    replayed from its own CUDA graph, and of the whole step."""
    model, runner = llm.model, llm.runner
    with decode_inputs(llm, batch, context) as (ctx, ids, positions):
        x = torch.randn(batch, model.config.hidden_size, device=runner.device, dtype=llm.dtype)
        cos, sin = model.cos[positions], model.sin[positions]
        layers = list(enumerate(model.layers))
        k, v = runner.k_caches, runner.v_caches
        with torch.inference_mode():  # the engine's weights are parameters: its ops refuse autograd (no backward)
            logits = model.logits(x)
        parts = {
            "attention": lambda: [layer.attention(x, cos, sin, ctx, k[i], v[i]) for i, layer in layers],
            "mlp": lambda: [layer.mlp(x) for _, layer in layers],
            "norms": lambda: [ops.add_rms_norm(x, x, w, model.config.rms_norm_eps)
                              for _, layer in layers for w in (layer.input_norm, layer.post_attention_norm)]
            + [ops.add_rms_norm(x, x, model.norm, model.config.rms_norm_eps)],
            "embedding and output head": lambda: (model.embed_tokens(ids), model.logits(x)),
            "sampling (greedy)": lambda: ops.argmax(logits),
            "whole step": lambda: model.logits(model(ids, positions, ctx, k, v)),
        }
        with torch.inference_mode():
            return {name: time_graph(fn).median_us for name, fn in parts.items()}


def layer_kernels(llm: LLM, context: int) -> list[str]:
    """The kernels one layer of a batch-1 decode step launches, in order: the GPU's kernels under torch.profiler
    (the call run once before, untimed, so Triton has compiled), or in the interpreter the launches
    ops._common.launch names ``triton::<kernel>``."""
    model, runner = llm.model, llm.runner
    layer, k, v = model.layers[0], runner.k_caches[0], runner.v_caches[0]
    with decode_inputs(llm, 1, context) as (ctx, ids, positions), torch.inference_mode():
        x = model.embed_tokens(ids)
        cos, sin = model.cos[positions], model.sin[positions]
        if model.features.fuses_decode_layer:
            call = lambda: layer.fused_decode(x, cos, sin, ctx, k, v)  # noqa: E731 (x: the stream, in place)
        else:
            residual = torch.zeros_like(x)
            call = lambda: layer(x, residual, cos, sin, ctx, k, v)  # noqa: E731
        call()
        sync()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                               if runtime.on_gpu() else [])
        with torch.profiler.profile(activities=activities) as prof:
            call()
            sync()
    if runtime.on_gpu():
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in prof.events() if e.name.startswith("triton::")]


def batch_1_decode_step(run, engines, config, weight_bytes, bandwidth, context):
    """The batch-1 decode step with Features.fused_decode_layer off (the engine's default) and on: kernels per
    layer, and on a GPU the whole step's time (its CUDA graph replayed: GPU time, the host left out) beside the
    step's bytes-read limit at this run's copy bandwidth (``bandwidth`` None: no timing, the interpreter)."""
    element = torch.empty((), dtype=run.dtype).element_size()
    step_bytes = weight_bytes + 2 * context * config.num_layers * config.num_kv_heads * config.head_dim * element
    limit_us = step_bytes / bandwidth * 1e6 if bandwidth else None
    off = engines.get(Impl.ENGINE_GRAPHS) or engines[Impl.ENGINE_EAGER]
    for impl, llm in ((Impl.ENGINE_GRAPHS if runtime.on_gpu() else Impl.ENGINE_EAGER, off),
                      (Impl.ENGINE_FUSED_DECODE, engines[Impl.ENGINE_FUSED_DECODE])):
        kernels = layer_kernels(llm, context)
        gpu_us = None
        if bandwidth:
            with decode_inputs(llm, 1, context) as (ctx, ids, positions), torch.inference_mode():
                model, k, v = llm.model, llm.runner.k_caches, llm.runner.v_caches
                gpu_us = time_graph(lambda: model.logits(model(ids, positions, ctx, k, v))).median_us
        run.add(Op.BATCH_1_DECODE_STEP, impl, {"batch": 1, "context": context}, kernels_per_layer=len(kernels),
                kernels=kernels, gpu_us=None if gpu_us is None else round(gpu_us, 2),
                limit_us=None if limit_us is None else round(limit_us, 2), bytes=step_bytes,
                fraction_of_limit=None if gpu_us is None else round(limit_us / gpu_us, 3),
                fused_decode_layer=llm.model.features.fuses_decode_layer)


def main():
    args = bench.parse_args(__doc__, "bench_engine.py", flags={
        "--ladder-only": "only the tokens/s ladder, its records put into the --out file in place of its ladder",
        "--qwen-shape": "a Qwen2.5-0.5B-shaped model instead of Llama-3.2-1B's (no ladder)",
        "--no-ladder": "everything but the tokens/s ladder; an --out file's ladder (records, notes) is kept"})
    dtype = runtime.dtype(cpu=torch.float32)
    run = bench.Run(Benchmark.ENGINE_QWEN if args.qwen_shape else Benchmark.ENGINE, smoke=args.smoke,
                    check_only=args.check, dtype=dtype)
    started = time.perf_counter()
    warm_up_gpu()
    folder = Path(tempfile.mkdtemp(prefix="bench-engine-", dir=runtime.scratch_dir()))
    try:
        if args.ladder_only:
            ladder_only(run, args.out, folder, started)
        else:
            benchmark(run, args.out, folder, started, qwen=args.qwen_shape, ladder=not args.no_ladder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the 1B checkpoint is 2.5 GB


def benchmark(run, out, folder, started, qwen=False, ladder=True):
    prompt_len, new_tokens = (8, 3) if run.smoke else (128, 128)
    batches = (2,) if run.smoke else (1, 8, 32)
    run.notes.update({"prompt_tokens": prompt_len, "new_tokens": new_tokens})
    generator = torch.Generator().manual_seed(0)
    shape, family = (TINY if run.smoke else QWEN_05B if qwen else LLAMA_1B), ("Qwen2" if qwen else "Llama")
    path = build_checkpoint(folder, shape, run.dtype, family)
    config = ModelConfig.from_folder(path)
    weight_bytes = config.weight_bytes(torch.empty((), dtype=run.dtype).element_size())
    run.notes["model"] = {"shape": shape, "family": family, "weight_bytes": weight_bytes,
                          "weights": f"random (torch.manual_seed(0)), transformers' {family}Config defaults otherwise"}
    max_len = prompt_len + new_tokens + 16
    engines = {Impl.ENGINE_GRAPHS: LLM(path, dtype=run.dtype, max_num_seqs=max(batches), max_model_len=max_len)}
    engines[Impl.ENGINE_EAGER] = LLM(path, dtype=run.dtype, max_num_seqs=max(batches), max_model_len=max_len,
                                     features=Features(cuda_graphs=False))
    if engines[Impl.ENGINE_GRAPHS].cuda_graphs:
        engines[Impl.ENGINE_GRAPHS_SYNC] = LLM(path, dtype=run.dtype, max_num_seqs=max(batches),
                                               max_model_len=max_len, features=Features(async_scheduling=False))
        if 1 in batches:
            engines[Impl.ENGINE_GRAPHS_CUBLAS] = LLM(path, dtype=run.dtype, max_num_seqs=1, max_model_len=max_len,
                                                     features=Features(gemv=False))
    else:
        del engines[Impl.ENGINE_GRAPHS]  # on CPU: no graphs, the two engines would be one
    engines[Impl.ENGINE_FUSED_DECODE] = LLM(path, dtype=run.dtype, max_num_seqs=1, max_model_len=max_len,
                                            features=Features(fused_decode_layer=True))
    run.notes["programmatic_dependent_launch"] = pdl()
    print(f"built and loaded in {time.perf_counter() - started:.0f} s", flush=True)
    low_model = hf_model(path, run.dtype)

    def prompts(batch):
        return random_prompts(batch, prompt_len, config.vocab_size, generator)

    run.notes["checks"] = check_engines(engines, path, low_model, prompts(min(8, max(batches))), new_tokens)
    if run.check_only:
        return
    time_generate(run, engines, low_model, prompts, batches, prompt_len, new_tokens, started)
    ceilings = {}
    if runtime.on_gpu():
        ceilings = measure_ceilings()
        middle = prompt_len + new_tokens // 2  # the context in the middle of a run
        step_parts(run, engines, config, weight_bytes, ceilings.bandwidth_gbs * 1e9, batches, middle)
    batch_1_decode_step(run, engines, config, weight_bytes, ceilings.bandwidth_gbs * 1e9 if ceilings else None,
                        prompt_len + new_tokens // 2)
    del engines, low_model  # the ladder builds its own engines, one at a time
    if runtime.on_gpu():
        torch.cuda.empty_cache()
    if ladder and not qwen:
        tokens_per_s_ladder(run, path, config, prompt_len, torch.Generator().manual_seed(1))  # a workload of its own
    elif not qwen and Path(out).exists():  # --no-ladder: the --out file's ladder kept, with its own provenance
        kept = load(out)
        run.records += [r for r in kept.records if r["op"] == Op.LADDER]
        if "ladder" in kept.notes:
            run.notes["ladder"] = {"provenance": {"command": kept.command, **kept.environment,
                                                  "seconds": kept.notes.get("seconds")}, **kept.notes["ladder"]}
    run.notes["vllm"] = "not measured: the benchmark machine has no vLLM, and it cannot be installed there"
    run.notes["seconds"] = round(time.perf_counter() - started, 1)
    run.save(out, ceilings)


def check_engines(engines, path, low_model, check_prompts, new_tokens) -> dict:
    """Each engine's logits against transformers in float64, and its greedy tokens against transformers in bf16:
    batched, and for the engine with CUDA graphs also one prompt alone (batch 1: its projections by ops.gemv)."""
    truth_model = hf_model(path, torch.float64)
    checks = {}
    batch_1_only = (Impl.ENGINE_GRAPHS_CUBLAS, Impl.ENGINE_FUSED_DECODE)
    runs = [(name, llm, check_prompts) for name, llm in engines.items() if name not in batch_1_only]
    runs += [(f"{name}, batch 1", llm, check_prompts[:1]) for name, llm in engines.items()
             if name in (Impl.ENGINE_GRAPHS, *batch_1_only)]
    for name, llm, chosen in runs:
        report = check_logits(llm, truth_model, low_model, chosen, min(CHECK_STEPS, new_tokens))
        ours, _ = engine_generate(llm, chosen, new_tokens)
        theirs, _ = hf_generate(low_model, chosen, new_tokens)
        report["greedy_tokens"] = first_divergence(ours, theirs, chosen, truth_model, low_model, llm.dtype)
        checks[name] = report
        errors = ", ".join(f"{s['max_error']:.3g} <= {s['allowed']:.3g}" for s in report["per_step"])
        greedy = report["greedy_tokens"]
        print(f"check {name}: logits {'passed' if report['passed'] else 'FAILED'} ({errors}); greedy tokens: "
              f"{greedy['identical']}/{len(chosen)} identical, divergences {greedy['diverged']}", flush=True)
    del truth_model
    if runtime.on_gpu():
        torch.cuda.empty_cache()
    return checks


def timed_at(name: str, batch: int) -> bool:
    """Whether a peer runs at this batch: the cuBLAS-projections and fused-decode-layer engines are ENGINE_GRAPHS
    itself past batch 1 (gemv and the fused layer serve a lone token only)."""
    return name not in (Impl.ENGINE_GRAPHS_CUBLAS, Impl.ENGINE_FUSED_DECODE) or batch == 1


def time_generate(run, engines, low_model, prompts, batches, prompt_len, new_tokens, started):
    """tokens/s of every peer at each batch size, then the engines' own decode-step times from their step logs."""
    peers = {Impl.HF_DYNAMIC: lambda p: hf_generate(low_model, p, new_tokens)}
    if runtime.on_gpu():
        peers[Impl.HF_STATIC] = lambda p: hf_generate(low_model, p, new_tokens, True)
    for name, llm in engines.items():
        peers[name] = lambda p, llm=llm: engine_generate(llm, p, new_tokens)
    for batch in batches:
        shape = {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens}
        for name, generate in peers.items():
            if not timed_at(name, batch):
                continue
            warm_start = time.perf_counter()
            try:
                generate(prompts(batch))  # compiles at this shape
                warm_up_s = time.perf_counter() - warm_start
                _, seconds = generate(prompts(batch))
            except Exception as e:  # a peer that fails here (e.g. a compile error) is recorded, not fatal
                run.notes.setdefault("failures", []).append(
                    {"impl": name, "batch": batch, "error": f"{type(e).__name__}: {e}"[:500]})
                print(f"FAILED {name} at batch {batch}: {type(e).__name__}: {e}", flush=True)
                continue
            run.add(Op.GENERATE, name, shape, seconds=round(seconds, 4),
                    tokens_per_s=round(batch * new_tokens / seconds, 1), warm_up_s=round(warm_up_s, 1),
                    elapsed_s=round(time.perf_counter() - started, 1))
        # The engine's own step log of the timed run: decode steps' mean wall time.
        for name, llm in engines.items():
            if not timed_at(name, batch):
                continue
            decode = [s.seconds for s in llm.steps if s.kind == "decode"]
            prefill = [s.seconds for s in llm.steps if s.kind == "prefill"]
            if decode and not any(f["impl"] == name and f["batch"] == batch for f in run.notes.get("failures", [])):
                run.add(Op.ENGINE_STEPS, name, shape, decode_step_us=round(1e6 * sum(decode) / len(decode), 1),
                        prefill_us=round(1e6 * sum(prefill), 1), decode_steps=len(decode))


def step_parts(run, engines, config, weight_bytes, bandwidth, batches, context):
    """One decode step (in the middle of a run), part by part, against its bytes-read limit (GPU only)."""
    run.notes["weight_read_limit_tokens_per_s_batch_1"] = round(bandwidth / weight_bytes, 1)
    llm = engines.get(Impl.ENGINE_GRAPHS) or next(iter(engines.values()))
    element = torch.empty((), dtype=run.dtype).element_size()
    for batch in batches:
        shape = {"batch": batch, "context": context}
        parts = step_breakdown(llm, batch, context)
        kv_bytes = 2 * batch * context * config.num_layers * config.num_kv_heads * config.head_dim * element
        step_bytes = weight_bytes + kv_bytes
        step_us = next((r["decode_step_us"] for r in run.records if r["op"] == Op.ENGINE_STEPS
                        and r["impl"] == Impl.ENGINE_GRAPHS and r["shape"]["batch"] == batch), None)
        host_us = step_us - parts["whole step"] - parts["sampling (greedy)"] if step_us is not None else None
        for part, us in parts.items():
            run.add(Op.DECODE_STEP_PART, Impl.ENGINE, shape, part=part, us=round(us, 2))
        if host_us is not None:
            run.add(Op.DECODE_STEP_PART, Impl.ENGINE, shape, part="host", us=round(max(host_us, 0.0), 2),
                    note="engine decode step (wall, CUDA graphs, asynchronous scheduling, mean over the timed run) "
                    "minus the GPU time of the whole step and of sampling: the time the GPU waits for the host "
                    "(scheduling, input preparation, launches, reading the tokens) that the overlap does not hide; "
                    "the synchronous engine's own step time is in its engine_steps record")
        run.add(Op.DECODE_STEP_LIMIT, Impl.WEIGHT_READ_LIMIT, shape, us=round(step_bytes / bandwidth * 1e6, 2),
                bytes=step_bytes, weight_bytes=weight_bytes, kv_bytes=kv_bytes)


def tokens_per_s_ladder(run, path, config, prompt_len, generator):
    """Each rung of the ladder on the same requests, after an untimed warm-up at the same prompt length and batch
    (Triton compiles at first call; CUDA graphs are captured when the engine is built, untimed): LADDER_REPEATS
    timed runs (two in the smoke run), then one under the profiler for the GPU's kernel time."""
    requests, seats, (low, high) = (3, 2, (1, 2)) if run.smoke else (64, 32, (16, 256))
    max_tokens = torch.randint(low, high + 1, (requests,), generator=generator).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    prompts = random_prompts(requests, prompt_len, config.vocab_size, generator)
    warm_up = None
    if runtime.on_gpu():
        warm_up = (random_prompts(seats, prompt_len, config.vocab_size, generator),
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    shape = {"requests": requests, "max_num_seqs": seats, "prompt": prompt_len, "max_tokens_low": low,
             "max_tokens_high": high}
    repeats = 2 if run.smoke else LADDER_REPEATS
    runs = run_ladder(path, prompts, params, warm_up=warm_up, progress=True, repeats=repeats, gpu_time=True,
                      dtype=run.dtype, max_num_seqs=seats, max_model_len=prompt_len + high + 16)
    top = runs[-1].tokens
    for rung in runs:
        slowest, fastest = rung.tokens_per_s_range
        gpu = rung.gpu_seconds
        run.add(Op.LADDER, rung.label, shape, tokens_per_s=round(rung.tokens_per_s, 1), seconds=round(rung.seconds, 3),
                tokens_per_s_min=round(slowest, 1), tokens_per_s_max=round(fastest, 1),
                seconds_runs=[round(x, 3) for x in rung.seconds_runs], repeats=len(rung.seconds_runs),
                repeats_same_tokens=rung.repeats_same_tokens,
                wall_us_per_step=round(1e6 * rung.seconds / rung.steps, 1),
                gpu_seconds=None if gpu is None else round(gpu, 4),
                gpu_us_per_step=None if gpu is None else round(rung.gpu_us_per_step, 1),
                gpu_tokens_per_s=None if gpu is None else round(rung.output_tokens / gpu, 1),
                output_tokens=rung.output_tokens, prefill_steps=rung.prefill_steps, decode_steps=rung.decode_steps,
                # greedy tokens identical to the top rung's (in 16 bits a near-tie may break the other way)
                same_tokens_as_top_rung=sum(a == b for a, b in zip(rung.tokens, top)))
    run.notes["ladder"] = {"max_tokens_per_request": max_tokens, "seed": "a torch.Generator of its own, seed 1",
                           "rungs": {r.label: vars(r.features) for r in runs},
                           "timing": f"{repeats} timed runs per rung on one engine: tokens_per_s is the median "
                                     "run's, tokens_per_s_min/max the slowest and fastest; gpu_* from one more run "
                                     "under torch.profiler (kernel time only, the GPU's waits for the host left out)"}


def ladder_only(run, out, folder, started):
    """``--ladder-only``: the ladder alone, its records and notes put into ``out`` in place of the ladder there
    (every other record, the ceilings and the file's provenance kept; the ladder's own go in notes["ladder"])."""
    if run.check_only:  # the ladder is timing alone; the engines' float64 checks are the full run's (--check)
        print("--ladder-only --check: the ladder checks nothing of its own; run --check alone for the engines' checks")
        return
    prompt_len = 8 if run.smoke else 128
    path = build_checkpoint(folder, TINY if run.smoke else LLAMA_1B, run.dtype)
    tokens_per_s_ladder(run, path, ModelConfig.from_folder(path), prompt_len, torch.Generator().manual_seed(1))
    run.notes["ladder"]["provenance"] = {"command": run.command, **environment(),
                                         "seconds": round(time.perf_counter() - started, 1)}
    if not Path(out).exists():
        run.save(out, {})
        return
    kept = load(out)
    records = [r for r in kept.records if r["op"] != Op.LADDER] + run.records
    written = Results(kept.benchmark, kept.command, kept.environment, kept.ceilings, records,
                      {**kept.notes, "ladder": run.notes["ladder"]}).save(out)
    print("wrote", written, "(the ladder replaced; every other record kept)")


if __name__ == "__main__":
    main()
