"""The figures of the instructor notebooks' markdown, each with what makes it true (kinds: tests/prose_figures.py).

Measured and Holds entries compute from the recorded GPU runs (``lessonlib/results/*.json``), the traffic models
(``lessonlib.traffic``) or the notebook's stored outputs (what CI's nbval run re-creates on the CPU). Bands are
stated where the text says "about" or "a few"; elsewhere a figure must round to the computed value.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import statistics

from lessonlib import kv_memory, reference, results, traffic
from lessonlib.results import Impl, Op
from tests.prose_figures import ROOT, VAGUE, Given, Holds, Measured, output

QUOTED = "a source text's own words, quoted; lesson 05's table of claims gives the verdict"


def quoted(notebook: str, cell: str, phrase: str, text: str = "the news item") -> Holds:
    """A phrase of a source text, quoted: its figures are the text's, and it must be in the quotation registry as the
    words of ``text`` (tests/test_quotations.py checks the registry against the texts themselves)."""
    from lessonlib.claims.quotations import registered

    return Holds(notebook, cell, f'"{phrase}"',
                 lambda: (registered(phrase) is not None and text.removeprefix("the ") in registered(phrase).sources),
                 f"{QUOTED}; registered in lessonlib/claims/quotations.py as {text}'s words")
A_FEW = 0.05  # "a few percent", "within a few percent": at most 5%
SEVERAL = 3.0  # "several times": at least three times


@functools.lru_cache(maxsize=None)
def run(name: str) -> results.Results:
    return results.load(name)


def timed(name: str, op: str, impl: str, **shape) -> dict:
    """The one plain record (no sweep, no per-call regime) of ``impl`` at ``shape``."""
    found = [r for r in run(name).select(op=op, impl=impl, **shape) if "regime" not in r and not r.get("sweep")]
    assert len(found) == 1, (name, op, impl, shape, found)
    return found[0]


def launches(op: str, impl: str) -> int:
    """GPU kernels per call that torch.profiler counted on the H200 (lesson 01, section 2)."""
    return run("fusion-h200").notes["launch_counts"]["counts"][op][impl]["total"]


# --- lesson 01 ----------------------------------------------------------------------------------------------------

SWIGLU, NORM = {"T": 8192, "I": 14336}, {"T": 8192, "H": 4096}
SWIGLU_BYTES, NORM_BYTES = traffic.swiglu(8192, 14336), traffic.add_rms_norm(8192, 4096)
MLP_TOKENS = (128, 2048, 8192)


def passes(model, which: str, elements: int, itemsize: int = 2) -> float:
    """How many times a chain's bytes cover one (elements,) tensor."""
    return getattr(model, which).bytes / (elements * itemsize)


def mlp(impl: str, t: int) -> float:
    return run("fusion-h200").one(op=Op.GATED_MLP, impl=impl, T=t)["us"]


def counted(fn, *shapes) -> int:
    """Kernels one float32 call of ``fn`` launches, counted live as the lesson counts them (``count_launches``);
    in float32 the dtype casts a 16-bit GPU run adds are no-ops."""
    import torch

    from lessonlib import runtime
    from lessonlib.measure import count_launches

    with torch.no_grad():
        return count_launches(fn, *(torch.randn(s, device=runtime.device()) for s in shapes)).total


def elementwise_saving(t: int) -> float:
    """What fusing silu·mul could save of eager's whole MLP at T=t: eager's silu·mul minus the swiglu kernel."""
    return (mlp(Impl.SHARE_EAGER_SILU_MUL, t) - mlp(Impl.SHARE_SWIGLU, t)) / mlp(Impl.EAGER, t)


def register_row(h: int, one_pass: bool) -> dict:
    return next(r for r in run("fusion-h200").notes["register_pressure"]["rows"]
                if r["H"] == h and r["one_pass"] == one_pass)


def rope_layout(layout: str, impl: str) -> float:
    rows = json.loads((ROOT / "benchmarks/experiments/results/rope-layout-h200.json").read_text())["rows"]
    return next(r["us"] for r in rows if r["layout"] == layout and r["impl"] == impl)


def int8_row(m: int) -> dict:
    """The recorded dequant_matmul layer at M=m, as lesson 01's table prints it (``measured.int8_weight_rows``)."""
    from lessonlib import measured

    return next(r for r in measured.int8_weight_rows(run("fusion-extras-h200")) if r["M"] == m)


def int8_speedup(m: int, peer: str) -> float:
    """The peer's time over the int8 kernel's at M=m: above 1 where the int8 kernel is faster."""
    return int8_row(m)["us"][peer] / int8_row(m)["us"][Impl.LESSONLIB]


def mlp_kernels(impl: str) -> dict:
    """The GPU kernels of one GatedMLP call at T=128 that the profiler listed on the H200 (name: count)."""
    return run("fusion-h200").notes["launch_counts"]["counts"][Op.GATED_MLP][impl]["kernels"]


def gemm_kernels(impl: str, down_proj: bool = True) -> int:
    """cuBLAS GEMM kernels (Hopper's ``nvjet_*``) in one GatedMLP call at T=128; without the down projection, whose
    K = I = 14336 made cuBLAS pick a split-K GEMM (``*_splitK_*``, plus a ``splitKreduce`` kernel that is no GEMM)."""
    return sum(n for name, n in mlp_kernels(impl).items()
               if name.startswith("nvjet") and (down_proj or "splitK" not in name))


def per_call_us(impl: str) -> float:
    """One call's time at T=1 issued back to back: the host's work and the GPU's, whichever is longer."""
    return run("fusion-h200").one(op=Op.LAUNCH_OVERHEAD, impl=impl)["us"]


def kernel_calls(path: str, kernel: str, call: str) -> int:
    """How many times ``call`` (``tl.load(``, ``tl.store(``) appears in one Triton kernel's body in ``path``."""
    body = (ROOT / path).read_text().split(f"def {kernel}(")[1].split("\ndef ")[0].split("\n@")[0]
    return body.count(call)


def saves_only_inputs_and_outputs() -> bool:
    """add_rms_norm's autograd node keeps nothing but tensors the call already has (its inputs and outputs): run on
    this machine's device (a GPU, or the CPU through Triton's interpreter) on a small case, its saved tensors compared
    by storage."""
    import torch

    from lessonlib import ops, runtime

    x, residual, weight = (torch.randn(s, device=runtime.device(), requires_grad=True)
                           for s in ((3, 8), (3, 8), (8,)))
    outputs = ops.add_rms_norm(x, residual, weight)
    had = {t.data_ptr() for t in (*outputs, x, residual, weight)}
    saved = outputs[0].grad_fn.saved_tensors
    return bool(saved) and all(t.data_ptr() in had for t in saved)


def elementwise_intensities() -> list[float]:
    """FLOPs per byte of every fused elementwise and normalisation kernel the lesson builds (traffic models at the
    lesson's shapes)."""
    t, i, h = 8192, 14336, 4096
    models = (traffic.swiglu(t, i), traffic.bias_swiglu(t, i), traffic.add_rms_norm(t, h),
              traffic.apply_rope(1, 32, 8, t, 128), traffic.absmax_normalize(t * h),
              traffic.absmax_normalize(t * h, strategy="one_program"), traffic.swiglu_backward(t, i),
              traffic.add_rms_norm_backward(t, h))
    return [k.flops / k.bytes for m in models for k in m.fused.kernels]


def swiglu_exercise_block() -> int:
    """Elements per program in the grid check_swiglu launches the student's kernel on."""
    from lessonlib.exercises import operator_fusion

    return operator_fusion.SWIGLU_BLOCK


def swiglu_recorded() -> dict:
    from lessonlib.exercises import predictions

    return predictions.SWIGLU.recorded()


LESSON_01 = (
    Measured("01_operator_fusion", "f1af300b", "Three GEMMs and two elementwise kernels", "two elementwise kernels",
             lambda: counted(reference.swiglu, (7, 33), (7, 33))),
    Measured("01_operator_fusion", "47c8f801", "does ~5 FLOPs per element", "5 FLOPs",
             lambda: SWIGLU_BYTES.fused.flops / (8192 * 14336)),
    Measured("01_operator_fusion", "47c8f801", "moves 6 bytes (bf16: two reads, one write) when fused", "6 bytes",
             lambda: passes(SWIGLU_BYTES, "fused", 8192 * 14336, 1)),
    Measured("01_operator_fusion", "47c8f801", "but 10 bytes in eager PyTorch", "10 bytes",
             lambda: passes(SWIGLU_BYTES, "eager", 8192 * 14336, 1)),
    Measured("01_operator_fusion", "47c8f801", "At ~1 FLOP per byte it is memory-bound", "1 FLOP",
             lambda: SWIGLU_BYTES.fused.flops / SWIGLU_BYTES.fused.bytes, within=0.5,
             why="~: the order of magnitude set against the ridge point"),
    Holds("01_operator_fusion", "fd628b60", "in the recorded run a little faster", lambda: 1 < timed(
        "fusion-h200", Op.SWIGLU, Impl.LESSONLIB, **SWIGLU)["gbps"] / timed(
        "fusion-h200", Op.COPY, "copy (same bytes)", **SWIGLU)["gbps"] < 1 + A_FEW,
          "swiglu's GB/s above the copy of the same bytes, by less than a few percent"),
    Given("01_operator_fusion", "fd628b60", "Only fewer bytes would make it much faster",
          "lesson 00's bound: a memory-bound kernel's time is its bytes over the bandwidth"),
    Measured("01_operator_fusion", "fd628b60", "Eager is slower by about the byte ratio of 5/3.", "5/3",
             lambda: timed("fusion-h200", Op.SWIGLU, Impl.EAGER, **SWIGLU)["us"] / timed(
                 "fusion-h200", Op.SWIGLU, Impl.LESSONLIB, **SWIGLU)["us"], within=5 / 3 * A_FEW * 2,
             why="about: within twice the run's few percent of the model's 5/3"),
    Measured("01_operator_fusion", "f0907044", "In eager PyTorch that is seven operators", "seven",
             lambda: counted(reference.add_rms_norm, (7, 33), (7, 33), (33,))),
    Measured("01_operator_fusion", "f0907044", "the profiler counted nine kernels on the H200", "nine kernels",
             lambda: launches(Op.ADD_RMS_NORM, Impl.EAGER)),
    Measured("01_operator_fusion", "f2ff0758", "4 passes over (T, H)", "4 passes",
             lambda: passes(NORM_BYTES, "fused", 8192 * 4096)),
    Measured("01_operator_fusion", "f2ff0758", "instead of about 21", "21",
             lambda: passes(NORM_BYTES, "eager", 8192 * 4096)),
    Measured("01_operator_fusion", "82f80785", "Eager moves 5.3x the bytes", "5.3x", lambda: NORM_BYTES.byte_ratio),
    Measured("01_operator_fusion", "82f80785", "in nine kernels on the GPU", "nine kernels",
             lambda: launches(Op.ADD_RMS_NORM, Impl.EAGER)),
    Holds("01_operator_fusion", "82f80785", "is slower than the fused kernel by more than that byte ratio",
          lambda: timed("fusion-h200", Op.ADD_RMS_NORM, Impl.EAGER, **NORM)["us"] / timed(
              "fusion-h200", Op.ADD_RMS_NORM, Impl.LESSONLIB, **NORM)["us"] > NORM_BYTES.byte_ratio,
          "eager's time over the fused kernel's, above the byte ratio"),
    Holds("01_operator_fusion", "82f80785", "within a few percent of a plain copy of the same bytes",
          lambda: abs(1 - timed("fusion-h200", Op.ADD_RMS_NORM, Impl.LESSONLIB, **NORM)["gbps"] / timed(
              "fusion-h200", Op.COPY, "copy (same bytes)", **NORM)["gbps"]) <= A_FEW, "GB/s within 5% of the copy"),
    Measured("01_operator_fusion", "b1ee40c2", "ten kernels on the H200", "ten kernels",
             lambda: launches(Op.APPLY_ROPE, Impl.EAGER)),
    Holds("01_operator_fusion", "4cd50369", "torch.compile's generated kernel is faster than lessonlib's RoPE",
          lambda: run("fusion-h200").one(op=Op.APPLY_ROPE, impl=Impl.COMPILE, T=8192)["us"]
          < run("fusion-h200").one(op=Op.APPLY_ROPE, impl=Impl.LESSONLIB, T=8192)["us"], "apply_rope at T=8192"),
    Measured("01_operator_fusion", "4cd50369", "(2 MB at T=8192)", "2 MB", lambda: 8192 * 128 * 2 / 1e6),
    Measured("01_operator_fusion", "4cd50369", "40 rows of 256 bytes", "256 bytes", lambda: 128 * 2),
    Holds("01_operator_fusion", "4cd50369", "the order reverses, and lessonlib's kernel is the faster of the two",
          lambda: rope_layout("token-major", "lessonlib") < rope_layout("token-major", "torch.compile")
          and rope_layout("head-major", "lessonlib") > rope_layout("head-major", "torch.compile"),
          "benchmarks/experiments/results/rope-layout-h200.json"),
    Given("01_operator_fusion", "4cd50369", "a T4's memory moves 320 GB/s, an H200's 4.8 TB/s",
          "NVIDIA's data sheets for the T4 and the H200"),
    Measured("01_operator_fusion", "8e5ef056", "runs three kernels", "three kernels",
             lambda: traffic.swiglu_backward(8192, 14336).eager.launches),
    Measured("01_operator_fusion", "8e5ef056", "`silu_backward`, 9 passes over a (T, I) tensor", "9 passes",
             lambda: passes(traffic.swiglu_backward(8192, 14336), "eager", 8192 * 14336)),
    Given("01_operator_fusion", "8e5ef056", "re-reading 2 bytes per element", "a bf16 element's size"),
    Measured("01_operator_fusion", "8e5ef056", "writes both gradients in one pass: 5 passes", "5 passes",
             lambda: passes(traffic.swiglu_backward(8192, 14336), "fused", 8192 * 14336)),
    Measured("01_operator_fusion", "20eb0c54", "3·H·I·2 bytes ≈ 352 MB", "352 MB",
             lambda: 3 * 4096 * 14336 * 2 / 1e6),
    *(Measured("01_operator_fusion", "20eb0c54", "takes about 15% of eager's whole MLP at T=128, 2048 and 8192",
               "15%", functools.partial(lambda t: 100 * mlp(Impl.SHARE_EAGER_SILU_MUL, t) / mlp(Impl.EAGER, t), t),
               within=1.0, why=f"about: ±1 point, at T={t}") for t in MLP_TOKENS),
    Holds("01_operator_fusion", "20eb0c54", "could save about a tenth of the MLP",
          lambda: all(0.08 <= elementwise_saving(t) <= 0.12 for t in MLP_TOKENS),
          "eager's silu·mul minus the swiglu kernel, 8-12% of eager's MLP at each T"),
    Measured("01_operator_fusion", "20eb0c54", "it is at most 7% faster than eager at any T", "7%",
             lambda: 100 * max(1 - mlp(Impl.FUSED_GATED_MLP, t) / mlp(Impl.EAGER, t) for t in (1, *MLP_TOKENS))),
    Holds("01_operator_fusion", "20eb0c54", "at T=8192 no faster at all",
          lambda: mlp(Impl.FUSED_GATED_MLP, 8192) >= mlp(Impl.EAGER, 8192), "the fused MLP's time at T=8192"),
    Given("01_operator_fusion", "20eb0c54", "whether the stacked GEMM is slower than the two it replaces is not measured",
          "a question no recorded run answers, stated as not known"),
    Given("01_operator_fusion", "a46b9beb", "of the 255 a thread can have",
          "NVIDIA's CUDA programming guide: at most 255 registers per thread"),
    Measured("01_operator_fusion", "a46b9beb", "at 32,768 columns 127", "127",
             lambda: register_row(32768, True)["registers_per_thread"]),
    Measured("01_operator_fusion", "a46b9beb", "runs at half the speed of a two-pass version", "half",
             lambda: register_row(65536, True)["gbps"] / register_row(65536, False)["gbps"], within=0.1,
             why="half: 0.4 to 0.6 of the two-pass GB/s"),
    Holds("01_operator_fusion", "dequant-matmul-limits", "**M = 1, batch-1 decode**, far below the ridge point",
          lambda: 5 * int8_row(1)["intensity"] <= int8_row(1)["ridge"], "far: 5x or more below the ridge point"),
    Given("01_operator_fusion", "dequant-matmul-limits", "The int8 kernel reads half the weight bytes",
          "one byte per int8 weight against two per 16-bit weight"),
    Holds("01_operator_fusion", "dequant-matmul-limits", "is faster than `F.linear` on the 16-bit weight",
          lambda: int8_speedup(1, Impl.LINEAR_16BIT) > 1, "F.linear's time over the int8 kernel's at M=1, above 1"),
    Measured("01_operator_fusion", "dequant-matmul-limits", "though by less than the 2x the bytes promise", "2x",
             lambda: int8_row(1)["bytes_16bit"] / int8_row(1)["bytes_int8"]),
    Holds("01_operator_fusion", "dequant-matmul-limits", "though by less than the 2x the bytes promise",
          lambda: int8_speedup(1, Impl.LINEAR_16BIT) < int8_row(1)["bytes_16bit"] / int8_row(1)["bytes_int8"],
          "the int8 kernel's gain at M=1 below the byte ratio"),
    Holds("01_operator_fusion", "dequant-matmul-limits", "it moves its bytes at a lower rate than cuBLAS's GEMV",
          lambda: int8_row(1)["bytes_int8"] / int8_row(1)["us"][Impl.LESSONLIB]
          < int8_row(1)["bytes_16bit"] / int8_row(1)["us"][Impl.LINEAR_16BIT], "GB/s of the bytes each must move, M=1"),
    Holds("01_operator_fusion", "dequant-matmul-limits", "**M = 2048, prefill**, far above it",
          lambda: int8_row(2048)["intensity"] >= 5 * int8_row(2048)["ridge"], "far: 5x or more above the ridge point"),
    Holds("01_operator_fusion", "dequant-matmul-limits", "cuBLAS's tensor-core GEMM runs at about the run's matmul ceiling",
          lambda: abs(int8_row(2048)["flops"] / int8_row(2048)["us"][Impl.LINEAR_16BIT] / 1e6
                      / run("fusion-extras-h200").ceilings["matmul_tflops"] - 1) <= A_FEW,
          "about: F.linear's TFLOP/s at M=2048 within 5% of the run's matmul ceiling"),
    Measured("01_operator_fusion", "dequant-matmul-limits", "reaches about half of it", "half of",
             lambda: int8_row(2048)["flops"] / int8_row(2048)["us"][Impl.LESSONLIB] / 1e6
             / run("fusion-extras-h200").ceilings["matmul_tflops"], within=0.1,
             why="about half: 0.4 to 0.6 of the run's matmul ceiling"),
    Holds("01_operator_fusion", "dequant-matmul-limits", "and is slower than `F.linear` and slightly slower than eager",
          lambda: int8_speedup(2048, Impl.LINEAR_16BIT) < 1 and 0.9 <= int8_speedup(2048, Impl.EAGER) < 1,
          "M=2048: slower than F.linear; slightly: eager's time over the int8 kernel's between 0.9 and 1"),
    Holds("01_operator_fusion", "dequant-matmul-limits", "**M = 16** is still below the ridge point, yet this kernel "
          "is slower than `F.linear` there", lambda: int8_row(16)["intensity"] < int8_row(16)["ridge"]
          and int8_speedup(16, Impl.LINEAR_16BIT) < 1, "M=16: below the ridge point, and F.linear's time shorter"),
    Measured("01_operator_fusion", "5086c767", "the fused kernel's GPU time is a few microseconds",
             "a few microseconds", lambda: mlp(Impl.SHARE_SWIGLU, 1)),
    # the question and the counts the sections state
    Given("01_operator_fusion", "9c51f10b", 'what does one kernel that does several ops at once ("fusion") win back?',
          "the lesson's question, with what fusion means (one kernel doing the work of several ops): it claims no "
          "count and no verdict; the sections answer it with the recorded run"),
    Holds("01_operator_fusion", "f1af300b", "cuBLAS may run one GEMM as more than one kernel",
          lambda: launches(Op.GATED_MLP, Impl.EAGER) > traffic.gated_mlp(128, 4096, 14336).eager.launches,
          "the profiled eager MLP at T=128 ran more kernels than its three GEMMs and two elementwise ops: the "
          "down projection ran as a split-K GEMM and a reduction kernel"),
    Holds("01_operator_fusion", "7ffaedfb", "(3·T·I·2)",
          lambda: traffic.swiglu(8192, 14336).fused.bytes == 3 * 8192 * 14336 * 2
          == timed("fusion-h200", Op.SWIGLU, Impl.LESSONLIB, **SWIGLU)["bytes"],
          "gate and up read, out written, 2 bytes each: the traffic model's fused bytes, and the bytes the recorded "
          "GB/s divides"),
    Holds("01_operator_fusion", "fd628b60", "The fused kernel moves its bytes as fast as a plain copy of the same bytes",
          lambda: abs(1 - timed("fusion-h200", Op.SWIGLU, Impl.LESSONLIB, **SWIGLU)["gbps"] / timed(
              "fusion-h200", Op.COPY, "copy (same bytes)", **SWIGLU)["gbps"]) <= A_FEW,
          "as fast as: swiglu's GB/s within a few percent (5%) of the copy of the same bytes"),
    Measured("01_operator_fusion", "fd628b60", "launches your kernel one program per 1,024 elements", "1,024",
             lambda: swiglu_exercise_block()),
    Holds("01_operator_fusion", "185efb39", "At T = 8192, I = 14336",
          lambda: (swiglu_recorded()["tokens"], swiglu_recorded()["intermediate"]) == (8192, 14336),
          "the shape of the recorded case the checker gives my_swiglu_ratio (predictions.SWIGLU)"),
    Measured("01_operator_fusion", "bb1c7659", "Two projections, one GEMM", "one GEMM",
             lambda: gemm_kernels(Impl.LESSONLIB, down_proj=False)),
    Measured("01_operator_fusion", "bb1c7659", "makes one GEMM that reads `x` once", "one GEMM",
             lambda: gemm_kernels(Impl.LESSONLIB, down_proj=False)),
    Measured("01_operator_fusion", "f0907044", "both outputs from one kernel", "one kernel",
             lambda: launches(Op.ADD_RMS_NORM, Impl.LESSONLIB)),
    Measured("01_operator_fusion", "b1ee40c2", "RoPE on q and k in one kernel", "one kernel",
             lambda: launches(Op.APPLY_ROPE, Impl.LESSONLIB)),
    *(Measured("01_operator_fusion", "4cd50369", quote, "40",
               lambda: sum(single({r["shape"][k] for r in run("fusion-h200").select(op=Op.APPLY_ROPE)})
                           for k in ("H", "Hkv")))
      for quote in ("which rotates all 40 heads of that", "reads 40 rows of 256 bytes from 40 distant places")),
    Holds("01_operator_fusion", "8e5ef056", "**Residual add + RMSNorm** saves nothing of its own",
          saves_only_inputs_and_outputs,
          "saves in autograd's sense: the op's backward node keeps only tensors it was given or returned"),
    *(Measured("01_operator_fusion", "f204f9d8", "the same grid, three loads, two stores", figure,
               functools.partial(kernel_calls, "lessonlib/ops/swiglu.py", "_swiglu_backward_kernel", call))
      for figure, call in (("three loads", "tl.load("), ("two stores", "tl.store("))),
    Measured("01_operator_fusion", "20eb0c54", "the three GEMMs do 2·3·T·H·I FLOPs", "three GEMMs",
             lambda: gemm_kernels(Impl.EAGER)),
    Holds("01_operator_fusion", "20eb0c54", "the three GEMMs do 2·3·T·H·I FLOPs",
          lambda: sum(k.flops for k in traffic.gated_mlp(8192, 4096, 14336).eager.kernels if "GEMM" in k.name)
          == 2 * 3 * 8192 * 4096 * 14336, "2 FLOPs per multiply-add, three GEMMs of T·H·I multiply-adds each"),
    Given("01_operator_fusion", "a46b9beb", "pair neighbours (2*i*, 2*i+1*)",
          "GPT-J's rotary pairing by its definition: element 2i with element 2i+1"),
    Holds("01_operator_fusion", "a46b9beb", "and at 65,536 the compiler *spills* to local memory",
          lambda: register_row(65536, True)["spilled_registers"] > 0
          and register_row(32768, True)["spilled_registers"] == 0,
          "the register report: spills at 65,536 columns, none at 32,768"),
    Holds("01_operator_fusion", "b7858ba3", "where launch overhead wins",
          lambda: all(per_call_us(call) > 2 * mlp(gpu, 1) for call, gpu in (
              (Impl.OPS_SWIGLU, Impl.SHARE_SWIGLU), (Impl.EAGER_SILU_MUL, Impl.SHARE_EAGER_SILU_MUL))),
          "at T=1 a call's time back to back is over twice its GPU time, for lessonlib's swiglu and for eager's "
          "silu·mul: the host's work is more than the kernel's"),
    Given("01_operator_fusion", "5086c767", "they replay a whole captured step with one launch",
          "what a CUDA graph is: the host launches the captured graph once (cudaGraphLaunch), whatever kernels it holds"),
    Measured("01_operator_fusion", "bias-swiglu", "`ops.bias_swiglu` does it in one pass", "one pass",
             lambda: traffic.bias_swiglu(8192, 14336).fused.launches),
    *(Given("01_operator_fusion", "dequant-matmul", quote, "float16 and bfloat16, the activations' dtypes, are "
            "16 bits wide") for quote in ("keeps activations in 16 bits", "converts the whole weight to 16 bits")),
    Measured("01_operator_fusion", "absmax-normalize-limits", "The launch boundary costs one launch", "one launch",
             lambda: traffic.absmax_normalize(1 << 20).fused.launches
             - traffic.absmax_normalize(1 << 20, strategy="one_program").fused.launches),
    # the summary
    Holds("01_operator_fusion", "41c205a7", "elementwise and normalisation kernels: under 2 FLOPs per byte",
          lambda: max(elementwise_intensities()) < 2, "every fused kernel of the lesson's elementwise and "
          "normalisation ops, forward and backward, in the traffic models"),
    Measured("01_operator_fusion", "41c205a7", "One kernel can return more than one output (add + RMSNorm)",
             "One kernel", lambda: launches(Op.ADD_RMS_NORM, Impl.LESSONLIB)),
    Holds("01_operator_fusion", "41c205a7", "Fusion stops paying where GEMMs dominate",
          lambda: all(s < 0.5 for s in (mlp(Impl.SHARE_EAGER_SILU_MUL, t) / mlp(Impl.EAGER, t) for t in (1, *MLP_TOKENS)))
          and all(mlp(Impl.FUSED_GATED_MLP, t) / mlp(Impl.EAGER, t) > 0.9 for t in (1, *MLP_TOKENS)),
          "the GatedMLP at every recorded T: eager's silu·mul under half of eager's MLP (the GEMMs, the rest, are "
          "most of it), and the fused MLP under 10% faster than eager"),
    Holds("01_operator_fusion", "41c205a7",
          "int8 weights in the GEMM pay where it is memory-bound (batch 1), not where it is compute-bound",
          lambda: int8_row(1)["intensity"] < int8_row(1)["ridge"] and int8_speedup(1, Impl.LINEAR_16BIT) > 1
          and int8_row(2048)["intensity"] > int8_row(2048)["ridge"] and int8_speedup(2048, Impl.LINEAR_16BIT) < 1,
          "the int8 kernel against F.linear on the 16-bit weight: faster at M=1, below the ridge point; slower at "
          "M=2048, above it"),
)

# --- lesson 02 ----------------------------------------------------------------------------------------------------

FA_SHAPES = ({"B": 2, "H": 32, "N": 4096, "D": 128, "causal": False},
             {"B": 2, "H": 32, "N": 4096, "D": 128, "causal": True},
             {"B": 4, "H": 16, "N": 2048, "D": 64, "causal": True})
BUDGET = {"B": 2, "H": 32, "N": 4096, "D": 128, "causal": False}
BUDGET_64 = {"B": 4, "H": 16, "N": 2048, "D": 64, "causal": False}


def fa(op: str, impl: str, shape: dict, field: str = "tflops") -> float:
    return run("flash-attention-h200").one(op=op, impl=impl, **shape)[field]


def fa_noise() -> float:
    """The run's noise: the default forward configuration timed twice (its own record, its sweep line)."""
    gaps = []
    for shape in FA_SHAPES:
        config = run("flash-attention-h200").notes["default_configs"][f"D={shape['D']}"]["forward"]
        label = "lessonlib " + " ".join(f"{k}={v}" for k, v in config.items())
        gaps.append(abs(fa(Op.FORWARD, Impl.LESSONLIB, shape) / fa(Op.FORWARD, label, shape) - 1))
    return max(gaps)


def versus(op: str, peer: str, shape: dict) -> float:
    return fa(op, Impl.LESSONLIB, shape) / fa(op, peer, shape)


def variant(impl: str, shape: dict) -> float:
    """A forward-loop variant's time over the unchanged loop's, same run."""
    return fa(Op.FORWARD_VARIANT, impl, shape, "us") / fa(Op.FORWARD_VARIANT, Impl.LOOP_COPY, shape, "us")


def decode_kv_bytes() -> float:
    shape = max((r["shape"] for r in run("flash-attention-h200").select(op=Op.DECODE)), key=lambda s: s["Nkv"])
    return 2 * shape["B"] * shape["H"] * shape["Nkv"] * shape["D"] * 2


def technique_tflops(op: str, impl: str, causal: bool) -> list[float]:
    """TFLOP/s of every timed configuration of one technique in the schedules run (a failed one has no time)."""
    return [r["tflops"] for r in run("flash-attention-schedules-h200").select(op=op, impl=impl, causal=causal)
            if r["us"] is not None]


def schedules_lessonlib_forward() -> float:
    return run("flash-attention-schedules-h200").one(op=Op.FORWARD, impl=Impl.LESSONLIB, causal=False)["tflops"]


FORWARD_TECHNIQUES = (Impl.TMA_DESCRIPTORS, Impl.TMA_WARP_SPECIALIZED, Impl.TMA_PERSISTENT)
CLOSE = 0.10  # "close to", "little more than": within 10%
APPENDIX = "appendix_measurements"  # the cells lesson 02's lab record moved to


def matmuls_only_share() -> float:
    """The forward loop's matrix products alone (softmax removed), in TFLOP/s, over cuBLAS's recorded rate."""
    us = fa(Op.FORWARD_VARIANT, Impl.MATMULS_ONLY, BUDGET, "us")
    flops = 4 * BUDGET["B"] * BUDGET["H"] * BUDGET["N"] ** 2 * BUDGET["D"]
    return flops / (us * 1e-6) / 1e12 / run("flash-attention-h200").ceilings["matmul_tflops"]


def cudnn_over_matmuls() -> float:
    """cuDNN's whole forward over the loop's matrix products alone, same shape, same run."""
    return fa(Op.FORWARD, Impl.SDPA_CUDNN, BUDGET, "us") / fa(Op.FORWARD_VARIANT, Impl.MATMULS_ONLY, BUDGET, "us")


def sdpa_launches() -> dict[int, int]:
    from lessonlib.cases.attention_launches import launch_counts

    return launch_counts(run("attention-launches-h200"), Impl.SDPA_FLASH)


def sdpa_splits_where_it_cuts_least() -> bool:
    """Where SDPA flash launches more than one kernel, they are split-KV and its combine, and its cut back to back
    there is below its cut at every length where it launches one."""
    from lessonlib.cases.attention_launches import time_cuts

    launches_run = run("attention-launches-h200")
    counts, cuts = sdpa_launches(), time_cuts(launches_run, Impl.SDPA_FLASH)
    split = [t for t, n in counts.items() if n > 1]
    kernels = [r["kernels"] for t in split
               for r in launches_run.select(op=Op.LAUNCH_BOUND_ATTENTION, impl=Impl.SDPA_FLASH, T=t)]
    named = all(any("splitkv_combine" in k for k in ks) and any("splitkv_kernel" in k for k in ks) for ks in kernels)
    return bool(split) and named and max(cuts[t] for t in split) < min(cuts[t] for t in counts if counts[t] == 1)


def naive_forward_share() -> float:
    """Naive attention's best forward TFLOP/s in the recorded run over cuBLAS's recorded rate."""
    naive = [r["tflops"] for r in run("flash-attention-h200").select(op=Op.FORWARD, impl=Impl.NAIVE)
             if r["us"] is not None]
    return max(naive) / run("flash-attention-h200").ceilings["matmul_tflops"]


def hint_count(name: str) -> int:
    from lessonlib import hints

    return len(hints.HINTS[name])


def forward_techniques_below_lessonlib() -> bool:
    """Every timed configuration of the Hopper forward techniques below lessonlib's forward, in the same run."""
    return all(t < schedules_lessonlib_forward() for i in FORWARD_TECHNIQUES
               for t in technique_tflops(Op.FORWARD, i, False))


def two_kernel_best_over_default() -> float:
    """The two-kernel backward's best configuration over its default, the larger of full and causal."""
    schedules = run("flash-attention-schedules-h200")
    default = list(schedules.notes["default_backward_config"]["dkdv"].values())
    ratios = []
    for causal in (False, True):
        timed = [r for r in schedules.select(op=Op.BACKWARD, impl=Impl.BACKWARD_TWO_KERNELS, causal=causal)
                 if r["us"] is not None]
        base = next(r["tflops"] for r in timed if r["tiles"] == default)
        ratios.append(max(r["tflops"] for r in timed) / base)
    return max(ratios)


def fa_shape_recorded(shape: dict) -> bool:
    """lessonlib's forward recorded at ``shape``, full and causal, in the run lesson 02 plots."""
    return all(run("flash-attention-h200").select(op=Op.FORWARD, impl=Impl.LESSONLIB, **shape, causal=causal)
               for causal in (False, True))


def backward_kernels() -> list[str]:
    """The kernels of lessonlib's backward, as the schedules run records its default tiles: one entry per kernel."""
    return list(run("flash-attention-schedules-h200").notes["default_backward_config"])


def launch_batches() -> set[int]:
    return {r["shape"]["B"] for r in run("attention-launches-h200").records}


def sdpa_backends_named() -> int:
    """The SDPA backends lesson 02's section 6 lists, each an ``SDPBackend`` member that torch has."""
    from torch.nn.attention import SDPBackend

    named = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    return sum(hasattr(SDPBackend, name) for name in named)


LESSON_02 = (
    Given("02_flash_attention", "b17c8f07", "At T = 8192 that matrix", "a length the lesson chooses to show the "
          "matrix at (a shape; the cell after shows why past T = 4·D it outweighs the rest)"),
    Given("02_flash_attention", "a9448b30", "Q, K, V and the output together hold 4·H·T·D",
          "a count: four tensors of H·T·D numbers each"),
    Given("02_flash_attention", "45a39ad3", "scores [1, 3] in the first tile and [2, 5] in the second, values 10, 20, "
          "30, 40", "the worked example's own numbers"),
    Given("02_flash_attention", "be501217", "starting from m = −inf, l = 0, acc = 0",
          "the online softmax's initial state: a definition (nothing seen: no maximum, empty sums)"),
    Holds("02_flash_attention", "ff044963", "One kernel accumulates dK and dV per key tile, another dQ per query tile",
          lambda: backward_kernels() == ["dkdv", "dq"],
          "the recorded run's backward tiles: one configuration for the dK/dV kernel, one for the dQ kernel"),
    Given("02_flash_attention", "e37b7166", "a query that sees no key gets 0",
          "reference.attention's rule for an empty row (a definition the spec states)"),
    Holds("02_flash_attention", "b461f08a", "B = 2, H = 32, N = 8192, D = 128",
          lambda: fa_shape_recorded({"B": 2, "H": 32, "N": 8192, "D": 128}),
          "lessonlib's forward recorded at that shape, full and causal, in flash-attention-h200"),
    Holds("02_flash_attention", "6dc7bcfa", "dispatches to one of several kernels",
          lambda: VAGUE["several"][0] <= sdpa_backends_named() <= VAGUE["several"][1],
          "the four SDPBackend members the sentence names, within what \"several\" means (tests/prose_figures.py)"),
    Given("02_flash_attention", "launch-bound-lead", "merging attention's softmax and matrix-product kernels into one "
          "launch", "the news item's claim in the course's words: it \"eliminates the need for separate softmax and "
          "matmul kernels\" (news item), the claim this section tests"),
    Given("02_flash_attention", "launch-bound-lead", "one kernel per operation",
          "what eager PyTorch is: each operation runs as its own kernel (the cell below counts them)"),
    Holds("02_flash_attention", "launch-bound-method", "times each at batch 1, causal",
          lambda: launch_batches() == {1} and all(r["shape"]["causal"] for r in run("attention-launches-h200").records),
          "attention-launches-h200: every record at B=1, causal"),
    Given("02_flash_attention", "launch-bound-method", "the time cut by fusion is 1 − fused / eager",
          "the definition the section gives"),
    Given("02_flash_attention", "203f0b91", "Prefill: N queries against N keys, 4·N²·D FLOPs per head",
          "the formula's coefficient: two matrix products (Q Kᵀ and P V) of 2 FLOPs per multiply-add"),
    Given("02_flash_attention", "203f0b91", "4·N·D FLOPs over the 2·N·D values of K and V, about one FLOP per byte",
          "the formula's coefficients: the same products for one query, over K and V (2 bytes a value in bf16)"),
    Given("02_flash_attention", "a9448b30", "past T = 4·D (512 at D = 128) the scores outweigh everything else",
          "the derivation the cell states: H·T² > 4·H·T·D exactly when T > 4·D"),
    Holds("02_flash_attention", "19cdc4e5", "it never gets near the GPU's matmul rate",
          lambda: naive_forward_share() < 0.1, "naive attention's best forward under a tenth of cuBLAS's rate"),
    Holds("02_flash_attention", "e37b7166", "prints the first of four hints",
          lambda: hint_count("flash_forward") == 4, "lessonlib.hints holds four hints for flash_forward"),
    Holds("02_flash_attention", "c6ad4afd", "the Triton kernel beats SDPA's FlashAttention-2 backend forward at every "
          "shape printed above and backward at D=128",
          lambda: all(versus(Op.FORWARD, Impl.SDPA_FLASH, s) > 1 + fa_noise() for s in FA_SHAPES)
          and all(versus(Op.BACKWARD, Impl.SDPA_FLASH, s) > 1 + fa_noise() for s in FA_SHAPES if s["D"] == 128),
          "TFLOP/s against SDPA flash, by more than the run's noise"),
    Holds("02_flash_attention", "c6ad4afd", "the D=64 backward is a tie, inside the run's noise (the default "
          "configuration, timed twice in the run, differs by a few percent between its two timings)",
          lambda: abs(versus(Op.BACKWARD, Impl.SDPA_FLASH, FA_SHAPES[2]) - 1) <= fa_noise() <= A_FEW,
          "D=64 backward within the noise; the noise at most a few percent"),
    Holds("02_flash_attention", "c6ad4afd", "It loses to cuDNN everywhere.",
          lambda: all(versus(op, Impl.SDPA_CUDNN, s) < 1 for op in (Op.FORWARD, Op.BACKWARD) for s in FA_SHAPES),
          "TFLOP/s below cuDNN's, forward and backward, at every shape"),
    Given("02_flash_attention", "c6ad4afd", "take the fastest", "the rule forward_config follows"),
    Given("02_flash_attention", "recorded-run-lead", "a card of 24 GB or less",
          "the view's rule for when naive attention's scores cannot fit, not a measurement"),
    Given("02_flash_attention", "recorded-run-lead", "at most 4,096 tokens", "the view's rule, as above"),
    Holds("02_flash_attention", "52eb79e3", "cuDNN is faster",
          lambda: fa(Op.FORWARD, Impl.SDPA_CUDNN, BUDGET, "us") < fa(Op.FORWARD, Impl.LESSONLIB, BUDGET, "us"),
          "cuDNN's forward time at the budget's shape"),
    Holds("02_flash_attention", "missing-time-read", "The matrix products alone run close to cuBLAS's rate.",
          lambda: matmuls_only_share() >= 1 - CLOSE, "within 10% of the recorded cuBLAS rate"),
    Holds("02_flash_attention", "missing-time-read", "cuDNN's whole forward takes little more than our matrix "
          "products alone", lambda: 1 <= cudnn_over_matmuls() <= 1 + CLOSE,
          "cuDNN's time at most 10% over the matrix products'"),
    Holds("02_flash_attention", "missing-time-read", "Cheaper exponentials did not make our loop faster",
          lambda: all(variant(i, s) >= 1 - fa_noise() for i in (Impl.LAZY_RESCALE, Impl.EXP2_16BIT)
                      for s in (BUDGET, BUDGET_64)), "no variant below the loop by more than the noise"),
    Holds("02_flash_attention", "missing-time-read", "and neither did Hopper's bulk tile copies (TMA), Triton 3.6's "
          "automatic warp specialization or a persistent grid",
          forward_techniques_below_lessonlib,
          "every timed configuration of the three techniques below lessonlib's forward in the same run"),
    Given("02_flash_attention", "launch-bound-lead", "the news item's \"up to 70%\"", QUOTED),
    Given("02_flash_attention", "launch-bound-lead", "\"cutting kernel launch overhead by up to 70%\"", QUOTED),
    Holds("02_flash_attention", "launch-bound-method", "from a handful of tokens to about a thousand",
          lambda: min(sdpa_launches()) <= 16 and 900 <= max(sdpa_launches()) <= 1100,
          "the recorded lengths: a handful (at most 16) to within 10% of a thousand"),
    Holds("02_flash_attention", "launch-bound-read", "SDPA's FlashAttention-2 is not always one launch",
          lambda: len(set(sdpa_launches().values())) > 1, "the kernels SDPA flash launched, per recorded T"),
    Holds("02_flash_attention", "launch-bound-read", "where the table shows it launching more kernels, it splits the "
          "keys among programs and combines their partial results in a second kernel (split-KV), and there its "
          "cut, back to back, is at its smallest", sdpa_splits_where_it_cuts_least,
          "split-KV and combine kernels recorded there; the cut there below every one-kernel length's"),
    Given("02_flash_attention", "launch-bound-read", "whether \"up to 70%\" is reached", QUOTED),
    Given("02_flash_attention", "203f0b91", "over about 4·N·D values moved", "the cell's own count: Q, K, V, O"),
    # The lab record: moved to the appendix notebook (its cells keep their ids).
    Given(APPENDIX, "appendix-02-title", "Hopper's fastest attention kernels",
          "FlashAttention-3 and cuDNN's, as the cells below name them: a description, not a measurement"),
    Given(APPENDIX, "appendix-02-sweep-lead", "`forward_config` takes the fastest", "the rule forward_config follows"),
    Given(APPENDIX, "schedules-lead", "lessonlib's two kernels (dK and dV per key tile, then dQ per query "
          "tile", "a count of the backward's kernels, named as the cell names them"),
    Holds(APPENDIX, "schedules-read", "None of the three makes the loop faster than lessonlib's kernel",
          forward_techniques_below_lessonlib,
          "every timed configuration of the three techniques below lessonlib's forward in the same run"),
    Holds(APPENDIX, "schedules-read", "the atomic schedule's best is slower than the two kernels' best, "
          "full and causal",
          lambda: all(max(technique_tflops(Op.BACKWARD, Impl.BACKWARD_ATOMIC_DQ, c))
                      < max(technique_tflops(Op.BACKWARD, Impl.BACKWARD_TWO_KERNELS, c)) for c in (False, True)),
          "the best TFLOP/s of each schedule, full and causal"),
    Holds(APPENDIX, "schedules-read", "Larger tiles move the two-kernel backward only a little from its default",
          lambda: two_kernel_best_over_default() <= 1 + A_FEW, "the best configuration within 5% of the default"),
    Given(APPENDIX, "schedules-read", "thousands of equal tiles",
          "B·H·N/BLOCK_M = 2·32·4096/128 = 2,048 query tiles at the shape timed"),
    Holds(APPENDIX, "schedules-read", "the readable forward loop is also the fastest Triton 3.6 forward found here",
          forward_techniques_below_lessonlib,
          "lessonlib's forward above every timed forward technique of the run"),
    Holds(APPENDIX, "flash-loop-variants", "It has to run about as fast as lessonlib's own kernel (printed below; "
          "a few percent is the spread between two timings)",
          lambda: abs(variant(Impl.LESSONLIB, BUDGET) - 1) <= A_FEW, "the loop copy within 5% of the kernel"),
    Holds(APPENDIX, "9b2f4eec", "The loop's matrix products alone run close to the rate of a large cuBLAS matrix "
          "product.", lambda: matmuls_only_share() >= 1 - CLOSE, "within 10% of the recorded cuBLAS rate"),
    Holds(APPENDIX, "9b2f4eec", "cuDNN adds little beyond our matrix products.",
          lambda: 1 <= cudnn_over_matmuls() <= 1 + CLOSE, "cuDNN's time at most 10% over the matrix products'"),
    Holds(APPENDIX, "9b2f4eec", "Neither trick makes our loop faster.",
          lambda: all(variant(i, s) >= 1 - fa_noise() for i in (Impl.LAZY_RESCALE, Impl.EXP2_16BIT)
                      for s in (BUDGET, BUDGET_64)), "no variant below the loop by more than the noise"),
    Holds(APPENDIX, "9b2f4eec", "exp2 in 16 bits ties the unchanged loop and lazy rescaling is slower",
          lambda: abs(variant(Impl.EXP2_16BIT, BUDGET) - 1) <= fa_noise() < variant(Impl.LAZY_RESCALE, BUDGET) - 1,
          "at D=128: exp2 within the noise, lazy rescaling beyond it"),
    Holds(APPENDIX, "9b2f4eec", "at D=64 (the same records, not plotted) both are slower",
          lambda: min(variant(i, BUDGET_64) for i in (Impl.LAZY_RESCALE, Impl.EXP2_16BIT)) - 1 > fa_noise(),
          "both variants beyond the noise at D=64"),
    Given(APPENDIX, "9b2f4eec", "a Triton 3.6 kernel", "a version number"),
    Holds(APPENDIX, "a07e8d92", "**Faster than the copy ceiling?** In the recorded run cuDNN's decode "
          "reads K and V faster than lesson 00's copy ceiling.",
          lambda: max(r["gbps"] for r in run("flash-attention-h200").select(op=Op.DECODE, impl=Impl.SDPA_CUDNN))
          > run("flash-attention-h200").recorded_ceilings().bandwidth_gbs,
          "cuDNN's decode GB/s against the copy ceiling measured in the same run"),
    Given(APPENDIX, "a07e8d92", "a kernel that only reads can go faster", "the reason the cell gives"),
    Holds(APPENDIX, "a07e8d92", "are over a hundred times the H200's L2 cache, which holds tens of "
          "megabytes", lambda: decode_kv_bytes() / 60e6 > 100,
          "K and V of the largest decode case against 60 MB (the full GH100 die's L2; products enable 50)"),
    Holds(APPENDIX, "a07e8d92", "A plain `torch.sum`, which also only reads, reaches no more than the copy",
          lambda: run("headline-h200").one(op=Op.READ, impl=Impl.SUM_READ)["gbps"]
          <= run("headline-h200").one(op=Op.READ, impl=Impl.COPY_READ_WRITE)["gbps"],
          "the headline run: the sum's GB/s against the copy's"),
    Holds(APPENDIX, "a07e8d92", "lies between cuDNN's figure and the 4.8 TB/s of its memory's data sheet",
          lambda: max(r["gbps"] for r in run("flash-attention-h200").select(op=Op.DECODE)) < 4800,
          "the fastest recorded decode below NVIDIA's H200 data sheet's 4.8 TB/s"),
)


def in_code(notebook: str, cell: str, text: str) -> bool:
    """Whether a code cell's source says ``text``: a size or shape the text names is the one the code uses."""
    from tests.prose_figures import flat, notebook as read

    return flat(text) in flat(next(c for c in read(notebook).cells if c.get("id") == cell).source)


def published(date: str) -> bool:
    from lessonlib.claims.quotations import NEWS

    return NEWS.date == date


DEFINITION = "a definition the sentence states, not a measurement"

# --- lessons 00, 03, 04 -------------------------------------------------------------------------------------------

LESSONS_00_03_04 = (
    quoted("00_setup_and_roofline", "fcaa2556", "cutting kernel launch overhead by up to 70%"),
    quoted("00_setup_and_roofline", "fcaa2556", "another 10–15% latency reduction"),
    Given("00_setup_and_roofline", "69b34320", "cannot finish faster than", "the roofline's definition"),
    Given("00_setup_and_roofline", "4255c7ba", "only fewer bytes make it faster", "what memory-bound means"),
    Measured("00_setup_and_roofline", "bb6397d8", "sit near **1 FLOP per byte**", "1 FLOP",
             lambda: SWIGLU_BYTES.fused.flops / SWIGLU_BYTES.fused.bytes, within=0.5,
             why="near: swiglu's 0.8 and add_rms_norm's 0.5 FLOP per byte (lessonlib.traffic)"),
    Given("00_setup_and_roofline", "80f98fd0", "what is the fastest it could possibly run", "a question"),
    Measured("03_paged_attention", "ddcdeaf3", "32 layers × 8 KV heads × 128 dims × K and V × 2 bytes = 128 KiB",
             "128 KiB", lambda: 32 * 8 * 128 * 2 * 2 / 1024),
    Holds("03_paged_attention", "72a2c10c", "under 1% at block size 16 here",
          lambda: kv_memory.reservation(kv_memory.request_lengths(n=256, median=600, max_len=4096), 4096,
                                        16).paged_waste < 0.01, "kv_memory over lesson 03's request lengths"),
    Given("03_paged_attention", "70ab587c", "half of D need not be a power of two", "arithmetic on a head size"),
    # lesson 00: the sources' citation, definitions, the roofline's sizes
    Holds("00_setup_and_roofline", "fcaa2556", "published by Tefisc Fact Engine on November 12, 2026",
          lambda: published("November 12, 2026"), "the news item's date as the quotation registry cites it"),
    Given("00_setup_and_roofline", "4255c7ba", "one kernel per operator", DEFINITION + " (what eager means)"),
    Holds("00_setup_and_roofline", "bb6397d8", "The GatedMLP's GEMMs at 8192 tokens are far above the ridge",
          lambda: traffic.gated_mlp(8192, 4096, 14336).fused.intensity > 5 * results.recorded_ceilings().ridge_intensity,
          "far above: more than five times the recorded ridge point, in FLOP per byte (lessonlib.traffic)"),
    Holds("00_setup_and_roofline", "61025d82", "at one token the GatedMLP is memory-bound, at 8192 it is compute-bound",
          lambda: "T=1: memory-bound" in output("00_setup_and_roofline", "350644c4")
          and "T=8192: compute-bound" in output("00_setup_and_roofline", "350644c4"), "the cell below's stored output"),
    Given("00_setup_and_roofline", "57443023", "the vector 0, 1, ..., BLOCK - 1", "tl.arange's definition"),
    Given("00_setup_and_roofline", "57443023", "the address of element 0", DEFINITION),
    Given("00_setup_and_roofline", "66c012c2", "masked lanes must add 0", "the identity of a sum"),
    Given("00_setup_and_roofline", "67019c48", "puzzles 1 and 2 with grids of 1, 2, 3, ... programs",
          "names of the puzzles above, and grid sizes counted up"),
    Given("00_setup_and_roofline", "587d83c8", "fuses each into one Triton kernel", "what lesson 01 builds: one kernel an op"),
    # lesson 03
    Holds("03_paged_attention", "ddcdeaf3", "256 requests with a realistic spread",
          lambda: in_code("03_paged_attention", "333e9b9a", "request_lengths(n=256"), "the requests the next cell draws"),
    Given("03_paged_attention", "72a2c10c", "16 is vLLM's default on GPUs",
          "vLLM's default block_size on CUDA (vllm's CacheConfig; the tutorial's example sets it too)"),
    Holds("03_paged_attention", "72a2c10c", "logical blocks 0 1 2 3 live in physical blocks 17 4 29 8",
          lambda: in_code("03_paged_attention", "633e3c78", "example_table = [17, 4, 29, 8]"),
          "the tutorial's block table, the one the next cell draws"),
    Given("03_paged_attention", "86bcb642", "append the blocks that reach 0 to `free_blocks`. A block already at 0",
          "a reference count of zero: a free block (the exercise's definition)"),
    Holds("03_paged_attention", "66a7ae15", "lengths from 1 to 100",
          lambda: "lengths 1-100" in output("03_paged_attention", "689dbf8d"), "the checker's stored report"),
    Holds("03_paged_attention", "70ab587c", "(80 / 2 = 40)",
          lambda: "head_dim 2 to 80" in output("03_paged_attention", "724fde6a"),
          "80: the largest head size the checker tries (its stored report); 40 is its half"),
    Given("03_paged_attention", "d16831f5", "the rotated k is written to memory by one kernel", DEFINITION),
    Given("03_paged_attention", "d16831f5", "here, one kernel that rotates q", "what the exercise writes: one kernel"),
    Given("03_paged_attention", "145d158f", "no longer written by one kernel and read back by the next, and one launch "
          "goes away", "two kernels made one (the exercise above)"),
    Holds("03_paged_attention", "145d158f", "a decode step of 64 sequences (Llama-3-8B's heads) and a prefill chunk of "
          "4,096 tokens", lambda: in_code("03_paged_attention", "1e1e0501",
                                          '(("decode, 64 sequences", 64), ("prefill, 4,096 tokens", 4096))'),
          "the sizes the next cell counts"),
    Given("03_paged_attention", "8a65b1ec", "With one sequence and 8 KV heads, one program per (sequence, KV head) "
          "would occupy 8 of the H200's 132 multiprocessors",
          "8: one sequence times 8 KV heads (Llama-3-8B's), one program each; 132: the H200's streaming "
          "multiprocessors (NVIDIA's H200 data sheet; the cell below uses it)"),
    Holds("03_paged_attention", "recorded-run-lead", "At decode sizes (1 to 64 tokens)",
          lambda: sorted({r["shape"]["T"] for r in run("paged-attention-h200").select(op=Op.ROPE_STORE_KV)})[:-1]
          == [1, 8, 32, 64], "the recorded rope_store_kv sizes below the 4,096-token prefill"),
    Holds("03_paged_attention", "50084557", "(B = 32, context 4096, 32 query heads, 8 KV heads, D = 128, bfloat16)",
          lambda: any(r["shape"] == {"B": 32, "context": 4096, "H": 32, "Hkv": 8, "D": 128, "block_size": 16}
                      and r["dtype"] == "bfloat16" for r in run("paged-attention-h200").select(
                          op=Op.PAGED_ATTENTION, impl=Impl.GATHER_THEN_SDPA)), "the recorded case the checker reads"),
    # lesson 04
    Given("04_torch_compile", "ed05ad69", "One kernel named after both ops", "the one name the cell above prints"),
    Holds("04_torch_compile", "2625863f", "(hidden 4096, intermediate 14336, bf16)",
          lambda: all(r["shape"]["H"] == 4096 and r["shape"]["I"] == 14336 and r["dtype"] == "bfloat16"
                      for r in run("cuda-graphs-h200").select(op=Op.GATED_MLP)), "the recorded GatedMLP's shape"),
    Given("04_torch_compile", "3a17e12f", "stay two GEMMs reading x twice", "the two projections, one GEMM each"),
    Holds("04_torch_compile", "recorded-run-lead", "the whole GatedMLP, where the GEMMs dominate",
          lambda: mlp(Impl.SHARE_EAGER_SILU_MUL, 8192) / mlp(Impl.EAGER, 8192) < 0.2,
          "dominate: the GEMMs take more than 80% of eager's time at T=8192 (the elementwise share is the rest)"),
    Measured("04_torch_compile", "2625863f", "three GEMMs that read 352 MB of weights", "352 MB",
             lambda: 3 * 4096 * 14336 * 2 / 1e6),
    Measured("04_torch_compile", "c7cbcca1", "Eager `silu(gate) * up` runs two kernels", "two kernels",
             lambda: SWIGLU_BYTES.eager.launches),
    Holds("04_torch_compile", "c7cbcca1", "the two differ by about one unit in the last place",
          lambda: 0.5 <= float(re.search(r"by at most ([\d.]+) units", output("04_torch_compile", "48f16569"))
                               .group(1)) <= 1.5, "the stored output's largest eager-fused difference"),
    Measured("04_torch_compile", "6e9a0abf", "measured `torch.compile` at 1.00x of lessonlib's swiglu speed", "1.00x",
             lambda: timed("fusion-h200", Op.SWIGLU, Impl.COMPILE, **SWIGLU)["gbps"] / timed(
                 "fusion-h200", Op.SWIGLU, Impl.LESSONLIB, **SWIGLU)["gbps"]),
    Holds("04_torch_compile", "61e06db5", "a kernel that runs for a few microseconds",
          lambda: mlp(Impl.SHARE_SWIGLU, 1) < 10, "lesson 01's swiglu kernel at T=1, under 10 µs"),
)

# --- lessons 05, 06, 07 -------------------------------------------------------------------------------------------

STEP_POINTS = ((1, 1024), (8, 1024), (64, 1024), (1, 8192), (8, 8192), (64, 8192))


def step(impl: str, b: int, context: int, field: str = "us") -> float:
    return run("cuda-graphs-h200").one(op=Op.DECODE_STEP, impl=impl, B=b, context=context)[field]


def graph_cut(b: int, context: int) -> float:
    return 1 - step(Impl.FUSED_STEP_GRAPH, b, context) / step(Impl.FUSED_STEP, b, context)


def fusion_cut(b: int, context: int) -> float:
    return 1 - step(Impl.FUSED_STEP, b, context) / step(Impl.EAGER_STEP, b, context)


def layer_weight_bytes(h: int = 4096, heads: int = 32, kv_heads: int = 8, d: int = 128, i: int = 14336) -> int:
    """One decoder layer's weights in bf16: q and o (H x H), k and v (H x kv_heads·D), gate, up and down."""
    return 2 * (2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * i)


def per_launch_us() -> float:
    """Eager silu·mul's whole call at one token, per kernel it launches: what a launch costs the host."""
    overhead = {r["impl"]: r["us"] for r in run("fusion-h200").select(op=Op.LAUNCH_OVERHEAD)}
    return overhead[Impl.EAGER_SILU_MUL] / 2


def ladder(rung: str) -> float:
    return run("engine-h200").one(op="tokens_per_s_ladder", impl=rung)["tokens_per_s"]


def near_ties() -> list[float]:
    """Gap over float16 spacing at every step where lesson 06's engines part (its stored output)."""
    text = output("06_vllm", "40a6fb2d")
    return [float(gap) / float(spacing) for gap, spacing in
            re.findall(r"logits are ([\d.]+) apart, .*? are ([\d.]+) apart", text, re.S)]


def launch_modes_within(band: float, tokens) -> bool:
    """Every launch mode of the recorded GatedMLP (lesson 05, cuda-graphs-h200) within ``band`` of eager's time."""
    records = run("cuda-graphs-h200").select(op=Op.GATED_MLP)
    eager = {r["shape"]["T"]: r["us"] for r in records if r["impl"] == Impl.EAGER}
    return all(abs(r["us"] / eager[r["shape"]["T"]] - 1) <= band for r in records if r["shape"]["T"] in tokens)


def live_ladder_seconds() -> dict[str, float]:
    rows = re.findall(r"^(\S.*?)\s+\d+\s+([\d.]+)\s+\d+\s+(?:yes|no)", output("07_serving_engine", "8a1d0c04"), re.M)
    return {rung: float(seconds) for rung, seconds in rows}


def chunked_prefill_case() -> tuple:
    """The recorded chunked-prefill run's dtype, hidden size, running decodes, long prompt and token budget."""
    recorded = run("chunked-prefill-h200")
    sizes = recorded.notes["sizes"]
    return (recorded.records[0]["dtype"], recorded.notes["model"]["shape"]["hidden_size"], sizes["decodes"],
            sizes["prompt"], sizes["budget"])


@functools.lru_cache(maxsize=None)
def saturation_ratios() -> tuple[float, ...]:
    """Chunked over prefill-first output tokens/s at saturation: the recorded serving run and the earlier run of the
    same day, kept in benchmarks/experiments/results/."""
    earlier = results.load(ROOT / "benchmarks/experiments/results/serving-h200-earlier-run.json")
    return tuple(r.notes["targets"]["saturation_chunked_over_prefill_first"] for r in (run("serving-h200"), earlier))


def engine_batches() -> list[int]:
    return sorted({r["shape"]["batch"] for r in run("engine-h200").select(op=Op.GENERATE)})


def ladder_rows() -> list[dict]:
    return run("engine-h200").select(op="tokens_per_s_ladder")


def ladder_row(rung: str) -> dict:
    return run("engine-h200").one(op="tokens_per_s_ladder", impl=rung)


def ladder_shape() -> dict:
    shapes = [r["shape"] for r in ladder_rows()]
    assert all(shape == shapes[0] for shape in shapes), shapes
    return shapes[0]


def two_rungs_carry_the_gain() -> bool:
    """The graph and batching rungs' gains are the ladder's two largest, and the only two whose slowest run beats the
    rung below's fastest."""
    rows = ladder_rows()
    gains = {r["impl"]: r["tokens_per_s"] / below["tokens_per_s"] for below, r in itertools.pairwise(rows)}
    beyond = {r["impl"] for below, r in itertools.pairwise(rows) if r["tokens_per_s_min"] > below["tokens_per_s_max"]}
    top_two = set(sorted(gains, key=gains.get)[-2:])
    return top_two == beyond == {Impl.RUNG_CUDA_GRAPHS, Impl.RUNG_CONTINUOUS_BATCHING}


def experiment_file(name: str) -> list[dict]:
    return json.loads((ROOT / f"benchmarks/experiments/results/{name}.json").read_text())["results"]


def single(values: set):
    assert len(values) == 1, values
    return values.pop()


def earlier_serving() -> results.Results:
    return results.load(ROOT / "benchmarks/experiments/results/serving-h200-earlier-run.json")


ENGINE_RUNS = ("engine-h200", "engine-qwen-h200")  # bench_engine.py's Llama-3.2-1B and Qwen2.5-0.5B shapes


def fused_decode_step(name: str) -> dict:
    """The recorded batch-1 decode step with Features.fused_decode_layer on (bench_engine.py's record)."""
    return next(r for r in run(name).select(op=Op.BATCH_1_DECODE_STEP) if r["fused_decode_layer"])


def fused_kernels_per_layer() -> int:
    """Kernels per layer of the recorded fused steps, one count for both models (-1 where they differ)."""
    counts = {fused_decode_step(name)["kernels_per_layer"] for name in ENGINE_RUNS}
    return counts.pop() if len(counts) == 1 else -1


def experiment(name: str) -> list[dict]:
    """A batch-1 experiment's rows (benchmarks/experiments/results/NAME.json)."""
    return json.loads((ROOT / f"benchmarks/experiments/results/{name}.json").read_text())["results"]


def qkv_attention_medians() -> dict[str, dict[str, float]]:
    """{shape: {layer: µs}}: each layer form's median over the interleaved rounds of decode_qkv_attention.py's run:
    "four" (attention in the qkv kernel, one split), "six" (paged_attention's own split count), "six, one split"."""
    rows = experiment("decode-qkv-attention-h200")
    forms = {"four": "four kernels", "six": "six kernels, paged_attention's",
             "six, one split": "six kernels, one split"}
    return {shape: {form: statistics.median(r["gpu_us"] for r in rows if r["shape"] == shape
                                            and r["layer"].startswith(prefix)) for form, prefix in forms.items()}
            for shape in {r["shape"] for r in rows}}


def four_kernel_layer_slower() -> bool:
    return all(m["four"] > m["six"] for m in qkv_attention_medians().values())


def serial_walk_costs_more_than_the_boundaries() -> bool:
    """The two boundaries save time (four kernels beat six at the same single split), and one split instead of
    paged_attention's (the walk the four-kernel layer does) costs more than they save."""
    return all(0 < m["six, one split"] - m["four"] < m["six, one split"] - m["six"]
               for m in qkv_attention_medians().values())


def barrier_us() -> float:
    """The grid barrier alone, µs per barrier, the mean over both widths of persistent_gemv_chain.py's run."""
    rows = [r for r in experiment("persistent-gemv-chain-h200") if "barriers alone" in r["impl"]]
    return statistics.mean(r["us_per_barrier"] for r in rows)


def persistent_chain_slower() -> bool:
    """Every persistent variant that ran against a decode_gemv kernel per product, µs per product, at each width."""
    rows = [r for r in experiment("persistent-gemv-chain-h200") if "us_per_gemv" in r]
    return all(min(r["us_per_gemv"] for r in rows if r["hidden"] == width and r["impl"].startswith("persistent"))
               > next(r["us_per_gemv"] for r in rows if r["hidden"] == width and r["impl"].startswith("ops."))
               for width in {r["hidden"] for r in rows})


LESSONS_05_06_07 = (
    Holds("05_cuda_graphs", "d7761079", "the GPU finishes it in a few microseconds",
          lambda: mlp(Impl.SHARE_SWIGLU, 1) < 10, "lesson 01's swiglu kernel at T=1, under 10 µs"),
    Holds("05_cuda_graphs", "d7761079", "the CPU spends several microseconds", lambda: 3 <= per_launch_us() <= 20,
          "eager silu·mul's call at one token, per launch, 3-20 µs"),
    Holds("05_cuda_graphs", "cd7fa19d", "Each launch costs the CPU a few microseconds",
          lambda: per_launch_us() <= 10, "eager silu·mul's call at one token, per launch, under 10 µs"),
    Given("05_cuda_graphs", "cd7fa19d", "At batch 1 the GPU work", "a batch size: one sequence"),
    Given("05_cuda_graphs", "d18f6aef", "into one launch cuts the time", "the news item's claim, as lesson 02 reads it"),
    Holds("05_cuda_graphs", "6ed56d69", "At batch 1 the layer's GPU work is reading its weights once (hidden 4096, "
          "intermediate 14336", lambda: all(r["shape"]["H"] == 4096 for r in run("cuda-graphs-h200").select(
              op=Op.DECODE_STEP)) and layer_weight_bytes() == layer_weight_bytes(4096, i=14336),
          "the recorded decode step's layer (Llama-3-8B's: hidden 4096, intermediate 14336)"),
    Given("05_cuda_graphs", "6ed56d69", "fusing attention's kernels into one launch", "the news item's claim"),
    Given("05_cuda_graphs", "6ed56d69", "its three GEMMs each read", "the GatedMLP's three projections"),
    Given("05_cuda_graphs", "bb4e1820", "At batch 1 the fused step's GPU work", "a batch size: one sequence"),
    Given("05_cuda_graphs", "bb4e1820", "the host's cost of one launch (lesson 01's recorded per-call cost of "
          "`lessonlib.ops.swiglu` at T = 1)", "the exercise's model: one launch's cost, at one token"),
    Holds("05_cuda_graphs", "bb4e1820", "(batch 1, context 1024)",
          lambda: step(Impl.FUSED_STEP_GRAPH, 1, 1024) > 0, "a recorded point of the decode step"),
    Holds("05_cuda_graphs", "c1a1ab00", "published by Tefisc Fact Engine on November 12, 2026",
          lambda: published("November 12, 2026"), "the news item's date as the quotation registry cites it"),
    quoted("05_cuda_graphs", "d18f6aef", "cutting kernel launch overhead by up to 70%"),
    quoted("05_cuda_graphs", "d18f6aef", "delivering another 10–15% latency reduction"),
    Measured("05_cuda_graphs", "6ed56d69", "about 0.4 GB in bf16", "0.4", lambda: layer_weight_bytes() / 1e9,
             within=0.05, why="about: one significant digit"),
    Holds("05_cuda_graphs", "6ed56d69", "about a hundred microseconds at the H200's bandwidth",
          lambda: 70 <= layer_weight_bytes() / (results.recorded_ceilings().bandwidth_gbs * 1e3) <= 140,
          "the layer's weights at the recorded copy bandwidth, 70-140 µs"),
    Holds("05_cuda_graphs", "6ed56d69", "The replayed step is several times faster than either eager step.",
          lambda: all(min(step(Impl.EAGER_STEP, 1, c), step(Impl.FUSED_STEP, 1, c))
                      / step(Impl.FUSED_STEP_GRAPH, 1, c) >= SEVERAL for c in (1024, 8192)),
          "at batch 1, both contexts"),
    Given("05_cuda_graphs", "6ed56d69", "the news item's \"up to 70%\"", QUOTED),
    Holds("05_cuda_graphs", "6ed56d69", "the plain PyTorch step loses the most to launching, because it launches "
          "more kernels", lambda: all(step(Impl.EAGER_STEP, b, c, "launches") > step(Impl.FUSED_STEP, b, c, "launches")
                                      for b, c in STEP_POINTS), "launches per step at every point"),
    quoted("05_cuda_graphs", "6ed56d69", "another 10–15%"),
    Given("05_cuda_graphs", "6ed56d69", "reading 64 × 8192 tokens of K and V", "the recorded point's batch and context"),
    Holds("05_cuda_graphs", "6ed56d69", "is not what a graph gives at small batch (far more) nor at B=64 with long "
          "contexts, where the GPU work (reading 64 × 8192 tokens of K and V) dwarfs the launches and the graph gains "
          "nothing.",
          lambda: all(graph_cut(b, c) > 0.15 for b, c in STEP_POINTS if b <= 8) and abs(graph_cut(64, 8192)) < A_FEW,
          "the graph's cut above 15% at B<=8, within 5% of nothing at B=64, context 8192"),
    Holds("05_cuda_graphs", "6ed56d69", "so at B=1 fusion saves less of the plain step than at larger batches",
          lambda: all(fusion_cut(1, c) < min(fusion_cut(8, c), fusion_cut(64, c)) for c in (1024, 8192)),
          "fusion's cut at B=1 below B=8's and B=64's, both contexts"),
    Holds("05_cuda_graphs", "6ed56d69", "At T = 1 and T = 8 the four ways of launching it cost the same, each within "
          "5% of eager's time", lambda: launch_modes_within(0.05, (1, 8)),
          "cost the same: every launch mode's recorded time within 5% of eager's, at T = 1 and T = 8"),
    Holds("06_vllm", "eacabcb7", "only accepts block sizes that are multiples of 32",
          lambda: "MultipleOf(32)" in output("06_vllm", "36c6a63c"), "vLLM's own error, stored below"),
    Holds("06_vllm", "eacabcb7", "(on a GPU, 16 is fine", lambda: __import__("lessonlib.serving", fromlist=["x"])
          .GPU_BLOCK_SIZE == 16, "the block size the lesson runs vLLM with on a GPU (serving.GPU_BLOCK_SIZE)"),
    Holds("06_vllm", "a93de2ff", "We use block_size 16 here",
          lambda: in_code("06_vllm", "936d076e", "block_size = 16"), "the next cell's block size"),
    Holds("06_vllm", "a93de2ff", "Two requests share a 40-token prefix",
          lambda: in_code("06_vllm", "936d076e", "system_prompt = list(range(100, 140))")
          and in_code("06_vllm", "936d076e", 'requests = {"req-A": system_prompt + [7, 8, 9], "req-B": system_prompt'),
          "the next cell's two requests and their 40-token system prompt"),
    Holds("06_vllm", "e766bc84", "(reference count 2) and give each request its own third block: the 8 prefix tokens",
          lambda: "ref counts {1: 2, 2: 2, 3: 1, 4: 1}" in output("06_vllm", "936d076e") and 40 - 2 * 16 == 8,
          "the stored reference counts; 8 = the 40-token prefix less two full blocks of 16"),
    Given("06_vllm", "c72fa95a", "runs one Triton kernel, `unified_attention`", "vLLM's TRITON_ATTN backend's one kernel"),
    Measured("06_vllm", "7bf7aa95", "In float16 a logit carries about 3 significant digits", "3",
             lambda: 11 * math.log10(2), within=0.5, why="float16's 11-bit significand (IEEE 754 binary16)"),
    Holds("06_vllm", "7bf7aa95", "On this lesson's CPU run the engines part where the gap is less than one spacing",
          lambda: bool(near_ties()) and all(r < 1 for r in near_ties()),
          "less than one: at least one parting in the stored output, and at every parting the gap over the float16 "
          "spacing below 1"),
    # lesson 07: the engine, the ladder, the batch-1 limit, latency
    Measured("07_serving_engine", "57690133", "must read every weight once: 2.47 GB", "2.47 GB",
             lambda: run("engine-h200").one(op="decode_step_limit", batch=1)["weight_bytes"] / 1e9),
    Holds("07_serving_engine", "57690133", "transformers' `generate` at batch 1, 8 and 32",
          lambda: engine_batches() == [1, 8, 32], "the recorded run's generate records"),
    Holds("07_serving_engine", "8a1d0c01", "64 requests for 32 seats, 128-token prompts, 16 to 256 new tokens each",
          lambda: ladder_shape() == {"requests": 64, "max_num_seqs": 32, "prompt": 128, "max_tokens_low": 16,
                                     "max_tokens_high": 256}, "the recorded ladder's workload"),
    Holds("07_serving_engine", "8a1d0c01", "Each rung ran three times",
          lambda: {r["repeats"] for r in ladder_rows()} == {3}, "the recorded ladder's timed runs per rung"),
    Holds("07_serving_engine", "ladder-reading", "\"+ CUDA graphs\", several times faster than the rung below it",
          lambda: ladder(Impl.RUNG_CUDA_GRAPHS) / ladder(Impl.RUNG_PAGED_DECODE) >= SEVERAL,
          "tokens/s of the recorded ladder"),
    Holds("07_serving_engine", "ladder-reading", "and keep the seats full (\"+ continuous batching\") carry the gain",
          two_rungs_carry_the_gain, "the graph and batching rungs: the two largest gains of the ladder, the only "
          "ones whose runs' ranges do not overlap the rung below's"),
    Holds("07_serving_engine", "ladder-reading", "The fused-ops and paged-decode rungs cut the GPU's time per step",
          lambda: all(ladder_row(rung)["gpu_us_per_step"] < ladder_row(below)["gpu_us_per_step"]
                      for rung, below in ((Impl.RUNG_FUSED_OPS, Impl.RUNG_PLAIN),
                                          (Impl.RUNG_PAGED_DECODE, Impl.RUNG_FLASH_PREFILL))),
          "the recorded ladder's GPU µs per step, each rung against the rung below it"),
    Holds("07_serving_engine", "dcf821c8", "the Llama-3.2-1B-shaped model in bfloat16, 32 running decodes, one "
          "4,096-token prompt, a 512-token budget",
          lambda: chunked_prefill_case() == ("bfloat16", 2048, 32, 4096, 512),
          "the recorded H200 run's dtype, model and sizes"),
    Holds("07_serving_engine", "aa3a828d", "The rates double, so a knee ratio is a power of two: 2x means one rate "
          "step higher.", lambda: all(b == 2 * a for a, b in itertools.pairwise(run("serving-h200").notes["sizes"][
              "rates"])), "the recorded run's rates, each twice the one before"),
    Holds("07_serving_engine", "8a1d0c03", "which is why the plain-PyTorch rung is the fastest here",
          lambda: min(live_ladder_seconds(), key=live_ladder_seconds().get) == "plain PyTorch",
          "the live ladder's stored output: the plain rung's seconds the least"),
    Measured("07_serving_engine", "batch-1-limit", "The fused layer's six kernels a layer still leave the step short "
             "of its bytes-read limit", "six kernels", fused_kernels_per_layer),
    Holds("07_serving_engine", "batch-1-limit", "The fused layer's six kernels a layer still leave the step short of "
          "its bytes-read limit", lambda: fused_decode_step("engine-h200")["fraction_of_limit"] < 1,
          "the recorded fused step's fraction of its bytes-read limit"),
    Measured("07_serving_engine", "batch-1-limit", "what was tried below six kernels a layer", "six kernels",
             fused_kernels_per_layer),
    # the appendix's lesson 07 section (cells moved out of lesson 07 keep their ids)
    Holds("appendix_measurements", "l07-engine-run", "128-token prompts with 128 new tokens at batch 1, 8 and 32",
          lambda: engine_batches() == [1, 8, 32] and all(
              r["shape"]["prompt"] == 128 and r["shape"]["new_tokens"] == 128
              for r in run("engine-h200").select(op=Op.GENERATE)), "the recorded run's generate records"),
    Holds("appendix_measurements", "l07-ladder-run", "three timed runs",
          lambda: {r["repeats"] for r in ladder_rows()} == {3}, "the recorded ladder's timed runs per rung"),
    Holds("appendix_measurements", "l07-ladder-run", "so few requests keep the top rung's tokens",
          lambda: all(r["same_tokens_as_top_rung"] <= 0.05 * r["shape"]["requests"] for r in ladder_rows()[:-1]),
          "few: at most 5% of the requests, every rung below the top"),
    Holds("appendix_measurements", "825f33c2", "reads fewer bytes per step than the Llama above but has more layers",
          lambda: (run("engine-qwen-h200").notes["model"]["weight_bytes"] < run("engine-h200").notes["model"][
              "weight_bytes"] and run("engine-qwen-h200").notes["model"]["shape"]["num_hidden_layers"]
              > run("engine-h200").notes["model"]["shape"]["num_hidden_layers"]), "the two recorded runs' models"),
    Measured("appendix_measurements", "l07-profile", "captures the fused step (six kernels a layer)", "six kernels",
             lambda: single({r["kernels_per_layer"] for r in experiment_file("decode-step-profile-h200")})),
    Measured("appendix_measurements", "fewer-kernels", "Below six kernels a layer", "six kernels",
             fused_kernels_per_layer),
    Measured("appendix_measurements", "fewer-kernels", "Neither model reaches its bytes-read limit with six kernels "
             "a layer", "six kernels", fused_kernels_per_layer),
    Holds("appendix_measurements", "fewer-kernels", "Neither model reaches its bytes-read limit",
          lambda: all(fused_decode_step(name)["fraction_of_limit"] < 1 for name in ENGINE_RUNS),
          "the recorded fused steps' fraction of their bytes-read limit, both models"),
    Holds("appendix_measurements", "fewer-kernels", "four kernels a layer. It is slower than six on both models",
          four_kernel_layer_slower, "benchmarks/experiments/results/decode-qkv-attention-h200.json, medians of the "
          "rounds, each shape"),
    Holds("appendix_measurements", "fewer-kernels", "one program then walks the whole context alone, which costs "
          "more than the two kernel boundaries it saves", serial_walk_costs_more_than_the_boundaries,
          "the same file: one split against paged_attention's costs more than four kernels save over six at one "
          "split, each shape"),
    Holds("appendix_measurements", "fewer-kernels", "slower per product than a kernel each", persistent_chain_slower,
          "benchmarks/experiments/results/persistent-gemv-chain-h200.json: the best persistent variant, each width"),
    Measured("appendix_measurements", "fewer-kernels", "the barrier alone takes about 1 µs", "about 1", barrier_us,
             within=0.5, why="about: one significant digit"),
    Given("appendix_measurements", "fewer-kernels", "reported 78% of an H100's bandwidth (2025)",
          "Hazy Research's post on their Llama-1B megakernel (May 2025), quoted"),
    Holds("appendix_measurements", "l07-chunked-tail", "one 4,096-token prompt",
          lambda: chunked_prefill_case()[3] == 4096, "the recorded H200 run's long prompt"),
    Holds("appendix_measurements", "l07-serving", "each rate is one burst of at most 250 requests",
          lambda: run("serving-h200").notes["sizes"]["requests"][1] == 250, "the recorded run's request bound"),
    Holds("appendix_measurements", "l07-serving", "put chunked prefill's saturation ratio below 0.95 where this one "
          "is above 1.05", lambda: saturation_ratios()[1] < 0.95 < 1.05 < saturation_ratios()[0],
          "the earlier and the recorded H200 run of the same day"),
    Holds("appendix_measurements", "l07-serving", "and transformers' knee lower",
          lambda: earlier_serving().notes["targets"]["knee_rate"][Impl.HF_SERVE]
          < run("serving-h200").notes["targets"]["knee_rate"][Impl.HF_SERVE], "the two runs' transformers knees"),
)

# --- lesson 07 and its appendix section: the figures the stricter check found ---------------------------------------

BATCH_1 = "the regime the limit is stated for, one sequence a step: a definition (section 8 computes the limit)"
MEGAKERNEL = "what a megakernel is: the whole step as one launch (Hazy Research's design, named beside it)"


def prefix_cached_tokens() -> int:
    """The most tokens a prompt of lesson 07's section 2 found in the prefix cache (its stored output)."""
    stored = output("07_serving_engine", "60724c85")
    return max(int(n) for n in re.findall(r"\(\s*(\d+) from the prefix cache\)", stored))


def code(name: str, cell: str) -> str:
    from tests.prose_figures import notebook

    return next(c.source for c in notebook(name).cells if c.get("id") == cell)


def live_ladder_requests() -> int:
    """Requests in the live ladder's cell: one ``max_tokens`` per request (its ``lengths``)."""
    return len(re.search(r"lengths = \[([^\]]*)\]", code("07_serving_engine", "8a1d0c04")).group(1).split(","))


def batch_1_only(*impls: str) -> bool:
    """Every generate record of ``impls`` in the recorded engine run is at batch 1, and there is one."""
    found = [r for r in run("engine-h200").select(op=Op.GENERATE) if r["impl"] in impls]
    return set(impls) == {r["impl"] for r in found} and all(r["shape"]["batch"] == 1 for r in found)


def pdl_chain() -> tuple[int, int]:
    """(layers, projections) of decode_layer_pdl.py's chain: its layers times the projection shapes it timed."""
    data = json.loads((ROOT / "benchmarks/experiments/results/decode-layer-pdl-h200.json").read_text())
    layers = single({r["layers"] for r in data["chain"]})
    return layers, layers * len({r["shape"] for r in data["single"]})


def experiment_context() -> int:
    """The context of the tables of the appendix's "Below six kernels a layer" (both step experiments)."""
    return single({json.loads((ROOT / f"benchmarks/experiments/results/{name}.json").read_text())["context"]
                   for name in ("decode-qkv-attention-h200", "decode-attention-latency-h200")})


LADDER_LESSONS = (("PyTorch ops, cuBLAS", "01"), ("PyTorch's SDPA", "02"), ("pages gathered, then SDPA", "03"),
                  ("kernels launched from Python", "05"), ("static batches", "07"))

LESSON_07 = (
    Given("07_serving_engine", "feba7d7b", "reading every weight at batch 1", BATCH_1),
    Measured("07_serving_engine", "d05674a3", "its first 32 tokens fill two 16-token blocks", "32",
             prefix_cached_tokens),
    Given("07_serving_engine", "d05674a3", "On a GPU, in 16 bits", "a data type's width: float16 and bfloat16"),
    Measured("07_serving_engine", "9aa765f0", "reading the 32 cached ones", "32", prefix_cached_tokens),
    Given("07_serving_engine", "2256609f", "Llama 3's RoPE scaling", "a model family's name"),
    *(Given("07_serving_engine", "8a1d0c01", f"| {plain} | {lesson} |", "the lesson each rung comes from: a place")
      for plain, lesson in LADDER_LESSONS),
    Measured("07_serving_engine", "8a1d0c03", "three requests for two seats", "three requests", live_ladder_requests),
    Given("07_serving_engine", "57690133", "The limit: reading every weight at batch 1", BATCH_1),
    Given("07_serving_engine", "57690133", "At batch 1 a decode step", BATCH_1),
    Given("07_serving_engine", "57690133", "launches step N+1 before it reads step N's tokens: step N+1 takes",
          "an index: the step after step N"),
    Given("07_serving_engine", "batch-1-limit", "What goes further is one kernel for the whole step", MEGAKERNEL),
    Given("07_serving_engine", "aa13bb20", "and 0 once it is spent", "the rule the exercise defines"),
    Given("07_serving_engine", "aa13bb20", "a prompt the budget does not reach gets 0",
          "the rule the exercise defines"),
    Given("07_serving_engine", "b1cd8e63", "at batch 1 the weight-read limit is the ceiling", BATCH_1),
    # the appendix: lesson 02's lab record and lesson 07's section
    Given(APPENDIX, "appendix-02-sweep-lead", "two measurements of one kernel at two moments of the run",
          "what the two timings are: the default configuration's own record and its line in the sweep, the same "
          "kernel (the registry's fa_noise computes their gap)"),
    Given(APPENDIX, "flash-loop-variants", "**exp2 in 16 bits**", "a data type's width: the variant's exponentials "
          "in a 16-bit float"),
    Given(APPENDIX, "schedules-lead", "against one kernel per key tile that adds its share of dQ",
          "the atomic schedule's design, as the cell describes it (FlashAttention-2's first schedule)"),
    Holds(APPENDIX, "schedules-read", "but Triton 3.6's automatic version",
          lambda: run("flash-attention-schedules-h200").environment["triton"].startswith("3.6."),
          "the Triton the schedules run recorded"),
    Holds(APPENDIX, "l07-engine-run", "at batch 1 also with cuBLAS for its projections",
          lambda: batch_1_only("lessonlib engine, CUDA graphs, cuBLAS projections", "lessonlib engine, fused decode "
                               "layer"), "the recorded run's cuBLAS-projection and fused-layer generate records"),
    Given(APPENDIX, "fewer-kernels", "What goes further is one kernel for the whole step", MEGAKERNEL),
    Measured(APPENDIX, "fewer-kernels", "each whole step's GPU time (context 192)", "192", experiment_context),
    Given(APPENDIX, "l07-streaming", "Do the projections stream as fast as a GEMV can?",
          "a question; the tables below answer it"),
    Measured(APPENDIX, "l07-streaming", "times the 64 projections of the 16 layers as one chain", "64",
             lambda: pdl_chain()[1]),
    Measured(APPENDIX, "l07-streaming", "times the 64 projections of the 16 layers as one chain", "16",
             lambda: pdl_chain()[0]),
)

FIGURES = LESSON_01 + LESSON_02 + LESSONS_00_03_04 + LESSONS_05_06_07 + LESSON_07
