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
from tests.prose_figures import ROOT, Given, Holds, Measured, output

QUOTED = "a source text's own words, quoted; lesson 05's table of claims gives the verdict"
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
    Holds("01_operator_fusion", "5086c767", "the fused kernel's GPU time is a few microseconds",
          lambda: mlp(Impl.SHARE_SWIGLU, 1) < 10, "the swiglu kernel inside the MLP at T=1, under 10 µs"),
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


LESSON_02 = (
    Given("02_flash_attention", "schedules-lead", "lessonlib's two kernels (dK and dV per key tile, then dQ per query "
          "tile", "a count of the backward's kernels, named as the cell names them"),
    Holds("02_flash_attention", "schedules-read", "None of the three makes the loop faster than lessonlib's kernel",
          lambda: all(t < schedules_lessonlib_forward() for i in FORWARD_TECHNIQUES
                      for t in technique_tflops(Op.FORWARD, i, False)),
          "every timed configuration of the three techniques below lessonlib's forward in the same run"),
    Holds("02_flash_attention", "schedules-read", "the atomic schedule's best is slower than the two kernels' best, "
          "full and causal",
          lambda: all(max(technique_tflops(Op.BACKWARD, Impl.BACKWARD_ATOMIC_DQ, c))
                      < max(technique_tflops(Op.BACKWARD, Impl.BACKWARD_TWO_KERNELS, c)) for c in (False, True)),
          "the best TFLOP/s of each schedule, full and causal"),
    Holds("02_flash_attention", "schedules-read", "the readable forward loop is also the fastest Triton 3.6 forward found here",
          lambda: all(t < schedules_lessonlib_forward() for i in FORWARD_TECHNIQUES
                      for t in technique_tflops(Op.FORWARD, i, False)),
          "lessonlib's forward above every timed forward technique of the run"),
    Given("02_flash_attention", "19cdc4e5", "launch overhead \"cut by up to 70%\"", QUOTED),
    Given("02_flash_attention", "launch-bound-lead", "\"cut by up to 70%\"", QUOTED),
    Given("02_flash_attention", "launch-bound-read", "whether \"up to 70%\" is reached", QUOTED),
    Holds("02_flash_attention", "c6ad4afd", "the Triton kernel beats SDPA's FlashAttention-2 backend forward at every "
          "shape printed above and backward at D=128",
          lambda: all(versus(Op.FORWARD, Impl.SDPA_FLASH, s) > 1 + fa_noise() for s in FA_SHAPES)
          and all(versus(Op.BACKWARD, Impl.SDPA_FLASH, s) > 1 + fa_noise() for s in FA_SHAPES if s["D"] == 128),
          "TFLOP/s against SDPA flash, by more than the run's noise"),
    Holds("02_flash_attention", "c6ad4afd", "the D=64 backward is a tie, inside the run's noise (the sweep below "
          "times the default configuration a second time, and the two timings differ by a few percent)",
          lambda: abs(versus(Op.BACKWARD, Impl.SDPA_FLASH, FA_SHAPES[2]) - 1) <= fa_noise() <= A_FEW,
          "D=64 backward within the noise; the noise at most a few percent"),
    Holds("02_flash_attention", "c6ad4afd", "It loses to cuDNN everywhere.",
          lambda: all(versus(op, Impl.SDPA_CUDNN, s) < 1 for op in (Op.FORWARD, Op.BACKWARD) for s in FA_SHAPES),
          "TFLOP/s below cuDNN's, forward and backward, at every shape"),
    Given("02_flash_attention", "c6ad4afd", "take the fastest (below)", "the rule forward_config follows"),
    Given("02_flash_attention", "recorded-run-lead", "a card of 24 GB or less",
          "the view's rule for when naive attention's scores cannot fit, not a measurement"),
    Given("02_flash_attention", "recorded-run-lead", "at most 4,096 tokens", "the view's rule, as above"),
    Holds("02_flash_attention", "52eb79e3", "cuDNN is faster",
          lambda: fa(Op.FORWARD, Impl.SDPA_CUDNN, BUDGET, "us") < fa(Op.FORWARD, Impl.LESSONLIB, BUDGET, "us"),
          "cuDNN's forward time at the budget's shape"),
    Holds("02_flash_attention", "52eb79e3", "It has to run about as fast as lessonlib's own kernel (printed below; "
          "a few percent is the spread between two timings)",
          lambda: abs(variant(Impl.LESSONLIB, BUDGET) - 1) <= A_FEW, "the loop copy within 5% of the kernel"),
    Holds("02_flash_attention", "9b2f4eec", "Neither trick makes our loop faster.",
          lambda: all(variant(i, s) >= 1 - fa_noise() for i in (Impl.LAZY_RESCALE, Impl.EXP2_16BIT)
                      for s in (BUDGET, BUDGET_64)), "no variant below the loop by more than the noise"),
    Holds("02_flash_attention", "9b2f4eec", "exp2 in 16 bits ties the unchanged loop and lazy rescaling is slower",
          lambda: abs(variant(Impl.EXP2_16BIT, BUDGET) - 1) <= fa_noise() < variant(Impl.LAZY_RESCALE, BUDGET) - 1,
          "at D=128: exp2 within the noise, lazy rescaling beyond it"),
    Holds("02_flash_attention", "9b2f4eec", "at D=64 (the same records, not plotted) both are slower",
          lambda: min(variant(i, BUDGET_64) for i in (Impl.LAZY_RESCALE, Impl.EXP2_16BIT)) - 1 > fa_noise(),
          "both variants beyond the noise at D=64"),
    Given("02_flash_attention", "9b2f4eec", "a Triton 3.6 kernel", "a version number"),
    Given("02_flash_attention", "203f0b91", "over about 4·N·D values moved", "the cell's own count: Q, K, V, O"),
    Holds("02_flash_attention", "a07e8d92", "**Faster than the copy ceiling?** In the recorded run cuDNN's decode "
          "reads K and V faster than lesson 00's copy ceiling.",
          lambda: max(r["gbps"] for r in run("flash-attention-h200").select(op=Op.DECODE, impl=Impl.SDPA_CUDNN))
          > results.recorded_ceilings().bandwidth_gbs, "cuDNN's decode GB/s against the recorded copy ceiling"),
    Given("02_flash_attention", "a07e8d92", "a kernel that only reads can go faster", "the reason the cell gives"),
    Holds("02_flash_attention", "a07e8d92", "are over a hundred times the H200's L2 cache, which holds tens of "
          "megabytes", lambda: decode_kv_bytes() / 60e6 > 100,
          "K and V of the largest decode case against 60 MB (the full GH100 die's L2; products enable 50)"),
    Given("02_flash_attention", "a07e8d92", "the 4.8 TB/s of its memory's data sheet", "NVIDIA's H200 data sheet"),
)

# --- lessons 00, 03, 04 -------------------------------------------------------------------------------------------

LESSONS_00_03_04 = (
    Given("00_setup_and_roofline", "fcaa2556", "launch overhead is \"cut by up to 70%\" and that CUDA graphs "
          "\"deliver another 10–15% latency reduction\"", QUOTED),
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
            re.findall(r"logits are ([\d.]+) apart, .*? are ([\d.]+) apart", text)]


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
    """Chunked over prefill-first output tokens/s at saturation: the committed serving run and the earlier run of the
    same session, kept in benchmarks/experiments/results/."""
    earlier = results.load(ROOT / "benchmarks/experiments/results/serving-h200-earlier-run.json")
    return tuple(r.notes["targets"]["saturation_chunked_over_prefill_first"] for r in (run("serving-h200"), earlier))


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
    Given("05_cuda_graphs", "d18f6aef", "launch overhead \"cut by up to 70%\"", QUOTED),
    Given("05_cuda_graphs", "d18f6aef", "\"deliver another 10–15% latency reduction\"", QUOTED),
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
    Holds("05_cuda_graphs", "6ed56d69", "\"Another 10–15%\" is not what a graph gives at small batch (far more) nor "
          "at B=64 with long contexts, where the GPU work (reading 64 × 8192 tokens of K and V) dwarfs the launches "
          "and the graph gains nothing.",
          lambda: all(graph_cut(b, c) > 0.15 for b, c in STEP_POINTS if b <= 8) and abs(graph_cut(64, 8192)) < A_FEW,
          "the graph's cut above 15% at B<=8, within 5% of nothing at B=64, context 8192"),
    Holds("05_cuda_graphs", "6ed56d69", "so at B=1 fusion saves less of the plain step than at larger batches",
          lambda: all(fusion_cut(1, c) < min(fusion_cut(8, c), fusion_cut(64, c)) for c in (1024, 8192)),
          "fusion's cut at B=1 below B=8's and B=64's, both contexts"),
    Measured("06_vllm", "7bf7aa95", "In float16 a logit carries about 3 significant digits", "3",
             lambda: 11 * math.log10(2), within=0.5, why="float16's 11-bit significand (IEEE 754 binary16)"),
    Holds("06_vllm", "7bf7aa95", "a gap of a few such steps", lambda: all(r <= 4 for r in near_ties()),
          "every parting's gap within four float16 spacings (the stored output)"),
    Measured("07_serving_engine", "57690133", "must read every weight once: 2.47 GB", "2.47 GB",
             lambda: run("engine-h200").one(op="decode_step_limit", batch=1)["weight_bytes"] / 1e9),
    Holds("07_serving_engine", "8a1d0c01", "\"+ CUDA graphs\", several times faster than the rung below it",
          lambda: ladder(Impl.RUNG_CUDA_GRAPHS) / ladder(Impl.RUNG_PAGED_DECODE) >= SEVERAL,
          "tokens/s of the recorded ladder"),
    Holds("07_serving_engine", "dcf821c8", "the Llama-3.2-1B-shaped model in bfloat16, 32 running decodes, one "
          "4,096-token prompt, a 512-token budget",
          lambda: chunked_prefill_case() == ("bfloat16", 2048, 32, 4096, 512),
          "the recorded H200 run's dtype, model and sizes"),
    Holds("07_serving_engine", "aa3a828d", "The rates double, so a knee ratio is a power of two: 2x means one rate "
          "step higher.", lambda: all(b == 2 * a for a, b in itertools.pairwise(run("serving-h200").notes["sizes"][
              "rates"])), "the recorded run's rates, each twice the one before"),
    Holds("07_serving_engine", "aa3a828d", "each rate is one burst of at most 250 requests",
          lambda: run("serving-h200").notes["sizes"]["requests"][1] == 250, "the recorded run's request bound"),
    Holds("07_serving_engine", "aa3a828d", "moved the chunked / prefill-first ratio by more than the 5% the target "
          "allows, in both directions", lambda: min(saturation_ratios()) < 0.95 and max(saturation_ratios()) > 1.05,
          "the two H200 runs of 2026-12-03: one under 0.95, one over 1.05"),
    Holds("07_serving_engine", "aa3a828d", "not as a measured 5%",
          lambda: run("serving-h200").notes["targets"]["targets"]["saturation_chunked_over_prefill_first"] == 0.95,
          "the target the run checks: 0.95"),
    Holds("07_serving_engine", "8a1d0c03", "which is why the plain-PyTorch rung is the fastest here",
          lambda: min(live_ladder_seconds(), key=live_ladder_seconds().get) == "plain PyTorch",
          "the live ladder's stored output: the plain rung's seconds the least"),
    Measured("07_serving_engine", "fewer-kernels", "Neither model reaches its bytes-read limit with six kernels a "
             "layer", "six kernels", fused_kernels_per_layer),
    Holds("07_serving_engine", "fewer-kernels", "Neither model reaches its bytes-read limit",
          lambda: all(fused_decode_step(name)["fraction_of_limit"] < 1 for name in ENGINE_RUNS),
          "the recorded fused steps' fraction of their bytes-read limit, both models"),
    Holds("07_serving_engine", "fewer-kernels", "four kernels a layer. It is slower than six on both models",
          four_kernel_layer_slower, "benchmarks/experiments/results/decode-qkv-attention-h200.json, medians of the "
          "rounds, each shape"),
    Holds("07_serving_engine", "fewer-kernels", "one program then walks the whole context alone, which costs more "
          "than the two kernel boundaries it saves", serial_walk_costs_more_than_the_boundaries,
          "the same file: one split against paged_attention's costs more than four kernels save over six at one "
          "split, each shape"),
    Holds("07_serving_engine", "fewer-kernels", "slower per product than a kernel each", persistent_chain_slower,
          "benchmarks/experiments/results/persistent-gemv-chain-h200.json: the best persistent variant, each width"),
    Measured("07_serving_engine", "fewer-kernels", "the barrier alone takes about 1 µs", "about 1", barrier_us,
             within=0.5, why="about: one significant digit"),
    Given("07_serving_engine", "fewer-kernels", "reported 78% of an H100's bandwidth (2025)",
          "Hazy Research's post on their Llama-1B megakernel (May 2025), quoted"),
)

FIGURES = LESSON_01 + LESSON_02 + LESSONS_00_03_04 + LESSONS_05_06_07
