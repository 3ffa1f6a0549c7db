"""The cases tools/compile_targets.py compiles: every kernel of lessonlib.ops, with the configuration its launcher
picks for a GPU profile, the arguments it is launched with there, and the launcher's own shared-memory estimate."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from lessonlib import runtime


@dataclass
class Case:
    """One kernel to compile: ``kernel.warmup(*args, **meta)`` as its launcher would launch it. ``estimate`` is the
    launcher's own shared-memory estimate for this configuration (None for kernels whose configuration does not
    depend on shared memory)."""

    op: str
    kernel: object
    label: str  # what varies between cases of one kernel
    dtype: torch.dtype
    args: tuple
    meta: dict
    estimate: int | None = None
    config: dict = field(default_factory=dict)
    planted: bool = False  # a configuration no launcher picks here, compiled to show that the check catches it

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def _contiguous_strides(*shape: int) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def dtypes_for(profile: runtime.GPUProfile) -> tuple[torch.dtype, ...]:
    """Every dtype the kernels accept on this profile (runtime.supported_dtypes() for it): no bfloat16 below sm_80."""
    return (torch.float32, torch.float16) + ((torch.bfloat16,) if profile.has_bfloat16 else ())


@dataclass
class _Target:
    """What every case of one profile reads: the profile, the profile a launcher is given (None: it asks the
    runtime), its programmatic dependent launch options, its dtypes, and whether to compile every dtype."""

    profile: runtime.GPUProfile
    given: runtime.GPUProfile | None
    pdl: dict
    all_dtypes: tuple
    half: tuple
    thorough: bool

    def pick(self, i: int, choices: tuple) -> tuple:
        return choices if self.thorough else (choices[i % len(choices)],)


def _attention_cases(t: _Target) -> list[Case]:
    """flash_attention's three kernels, paged_attention's two, paged_prefill_attention."""
    fa = sys.modules["lessonlib.ops.flash_attention"]
    pa = sys.modules["lessonlib.ops.paged_attention"]
    pp = sys.modules["lessonlib.ops.paged_prefill_attention"]
    profile, given, all_dtypes, half, pick = t.profile, t.given, t.all_dtypes, t.half, t.pick
    f32 = torch.float32
    out: list[Case] = []
    # flash_attention: (B, H, N, D) = (2, 32, 4096, D) contiguous, as the benchmark's target shapes.
    for i, (head_dim, causal) in enumerate(((64, False), (128, True))):
        qs = _contiguous_strides(2, 32, 4096, head_dim)[:3]
        for dtype in pick(i, half):
            forward = fa.forward_config(head_dim, given)
            out.append(Case("flash_attention", fa._flash_attention_forward_kernel, f"D={head_dim} causal={causal}",
                            dtype, (dtype, dtype, dtype, dtype, f32, *qs * 4, 32, 4096, 4096, head_dim ** -0.5),
                            dict(GROUP=1, CAUSAL=causal, HEAD_DIM=head_dim, **forward),
                            fa.forward_shared_memory(forward, head_dim, profile, dtype.itemsize), forward))
            backward = fa.backward_config(head_dim, given)
            for kernel, key, extra in ((fa._flash_attention_dkdv_kernel, "dkdv", (dtype, dtype)),
                                       (fa._flash_attention_dq_kernel, "dq", (dtype,))):
                config = backward[key]
                heads = (32, 32) if key == "dkdv" else (32,)
                out.append(Case("flash_attention", kernel, f"D={head_dim} causal={causal}", dtype,
                                (dtype, dtype, dtype, dtype, f32, f32, *extra, *qs * 4, *heads, 4096, 4096,
                                 head_dim ** -0.5),
                                dict(GROUP=1, CAUSAL=causal, HEAD_DIM=head_dim, **config),
                                fa.backward_shared_memory(config, head_dim, profile, dtype.itemsize), config))

    # paged_attention: a pool of 2048 blocks of 16 tokens, 8 KV heads, batch 32 with 256-block tables.
    block_size, kv_heads = 16, 8
    paged = [(128, (1, 4, 8)[j], dtype) for j, dtype in enumerate(all_dtypes)] + [(256, 8, half[-1])]
    if t.thorough:
        paged += [(256, 4, dtype) for dtype in all_dtypes]
    for head_dim, group, dtype in paged:
        config = pa.split_config(head_dim, block_size, group, dtype, given)
        cache = _contiguous_strides(2048, block_size, kv_heads, head_dim)
        heads = kv_heads * group
        out.append(Case(
            "paged_attention", pa._paged_attention_split_kernel, f"D={head_dim} GROUP={group}", dtype,
            (dtype, dtype, dtype, torch.int32, torch.int32, f32, f32, f32, head_dim ** -0.5,
             heads * head_dim, head_dim, 256, *cache[:3], 8, 32),
            dict(GROUP=group, BLOCK_G=max(16, pa.next_power_of_2(group)), PAGE_SIZE=block_size,
                 HEAD_DIM=head_dim, INPUT_PRECISION="ieee" if dtype == f32 else "tf32",
                 PRECISE_EXP=dtype == f32, **config),
            pa.split_shared_memory(config, head_dim, block_size, group, dtype.itemsize), config))
    most_splits = pa.num_splits_for(1, 1, 1 << 20, profile.multiprocessors)
    config = dict(BLOCK_S=pa.next_power_of_2(most_splits), num_warps=pa.REDUCE_WARPS)
    for dtype in half:
        out.append(Case("paged_attention", pa._paged_attention_reduce_kernel, f"splits={most_splits} D=256", dtype,
                        (f32, f32, f32, dtype, most_splits), dict(HEAD_DIM=256, PRECISE_EXP=False, **config),
                        config=config))

    # paged_prefill_attention: 4096 packed new tokens, 32 query heads over 8 KV heads, the pool above; D=128 in every
    # dtype (its ladder depends on D x element size only).
    for dtype in all_dtypes:
        config = pp.config(128, dtype.itemsize, given)
        cache = _contiguous_strides(2048, block_size, kv_heads, 128)
        out.append(Case(
            "paged_prefill_attention", pp._paged_prefill_attention_kernel, "D=128 GROUP=4", dtype,
            (dtype, dtype, dtype, torch.int32, torch.int32, torch.int32, dtype, 128 ** -0.5, 32 * 128, 128, 256,
             *cache[:3]),
            dict(GROUP=4, PAGE_SIZE=block_size, HEAD_DIM=128, INPUT_PRECISION="ieee" if dtype == f32 else "tf32",
                 PRECISE_EXP=dtype == f32, **config),
            pp.shared_memory(config, 128, profile, dtype.itemsize), config))
    return out


def _elementwise_cases(t: _Target) -> list[Case]:
    """The fused element-wise ops at their largest blocks, and argmax."""
    sw = sys.modules["lessonlib.ops.swiglu"]
    rn = sys.modules["lessonlib.ops.add_rms_norm"]
    rp = sys.modules["lessonlib.ops.apply_rope"]
    kv = sys.modules["lessonlib.ops.store_kv"]
    rk = sys.modules["lessonlib.ops.rope_store_kv"]
    am = sys.modules["lessonlib.ops.argmax"]
    given, pdl, all_dtypes = t.given, t.pdl, t.all_dtypes
    f32 = torch.float32
    out: list[Case] = []
    # The fused element-wise ops, at their largest blocks.
    for dtype in all_dtypes:
        config = sw.config(14336, given)
        out.append(Case("swiglu", sw._swiglu_kernel, "I=14336", dtype, (dtype, dtype, dtype, 14336, 28672, 28672, 14336),
                        config, config=config))
        out.append(Case("swiglu", sw._swiglu_backward_kernel, "I=14336 backward", dtype,
                        (dtype, dtype, dtype, dtype, dtype, 14336, 14336, 28672, 28672), config, config=config))
        for n_cols in (rn.MAX_ONE_PASS_COLS, 2 * rn.MAX_ONE_PASS_COLS):
            config = rn.config(n_cols, given)
            out.append(Case("add_rms_norm", rn._add_rms_norm_kernel, f"H={n_cols}", dtype,
                            (dtype, dtype, dtype, dtype, dtype, n_cols, n_cols, n_cols, 1e-6), {**config, **pdl},
                            config=config))
            out.append(Case("add_rms_norm", rn._add_rms_norm_backward_kernel, f"H={n_cols} backward", dtype,
                            (dtype, dtype, dtype, dtype, dtype, f32, 8192, n_cols, 32, n_cols, n_cols, 1e-6), config,
                            config=config))
        config = rp.config(32, 8, 128, given)
        q_strides, k_strides = _contiguous_strides(2, 32, 4096, 128)[:3], _contiguous_strides(2, 8, 4096, 128)[:3]
        for inverse in (False, True):  # the forward, and the backward's inverse rotation
            out.append(Case("apply_rope", rp._apply_rope_kernel, f"H=32 Hkv=8 D=128{' inverse' if inverse else ''}",
                            dtype, (dtype, dtype, dtype, dtype, dtype, dtype, 4096, 32, 8, 64, *q_strides, *k_strides,
                                    0, 128, 0, 128, *q_strides, *k_strides), dict(config, INVERSE=inverse),
                            config=config))
        config = kv.config(8 * 128, given)
        out.append(Case("store_kv", kv._store_kv_kernel, "Hkv=8 D=128", dtype,
                        (dtype, dtype, dtype, dtype, torch.int64, 1024, 1024, 1024), config, config=config))
        config = rk.config(32, 8, 128, given)  # qkv rows of (32 + 2 * 8) * 128 elements
        out.append(Case("rope_store_kv", rk._rope_store_kv_kernel, "H=32 Hkv=8 D=128", dtype,
                        (dtype, dtype, dtype, torch.int64, dtype, dtype, dtype, 48 * 128, 128, 128, 32, 8, 64),
                        config, config=config))
        # The engine's greedy sampling, over Llama 3's vocabulary, a non-finite row given ABORTED (-2).
        config = {"BLOCK": am.BLOCK, "CHECK_FINITE": True, "num_warps": 4}
        out.append(Case("argmax", am._argmax_chunk_kernel, "V=128256", dtype,
                        (dtype, f32, torch.int64, 128256, 128256, 4096, -2), {**config, **pdl}, config=config))
    return out


def _fusion_extra_cases(t: _Target) -> list[Case]:
    """Lesson 01's further fusions: bias_swiglu, absmax_normalize, dequant_matmul."""
    bs = sys.modules["lessonlib.ops.bias_swiglu"]
    dq = sys.modules["lessonlib.ops.dequant_matmul"]
    an = sys.modules["lessonlib.ops.absmax_normalize"]
    given, half = t.given, t.half
    f32 = torch.float32
    out: list[Case] = []
    # Lesson 01's further fusions: bias_swiglu at I=14336, absmax_normalize over 8192 x 4096 elements, and
    # dequant_matmul's two tile shapes for a 4096 -> 14336 layer (float32 at the prefill tile only).
    n = 8192 * 4096
    for dtype in half:
        config = bs.config(14336, given)
        out.append(Case("bias_swiglu", bs._bias_swiglu_kernel, "I=14336", dtype,
                        (dtype, dtype, dtype, dtype, dtype, 14336, 28672, 28672), config, config=config))
        config = dict(BLOCK=an.block_for(n), num_warps=an.num_warps_for(an.block_for(n)))
        out.append(Case("absmax_normalize", an._absmax_partials_kernel, f"n={n}", dtype, (dtype, f32, n), config,
                        config=config))
        out.append(Case("absmax_normalize", an._absmax_scale_kernel, f"n={n}", dtype,
                        (dtype, f32, dtype, n, an.MAX_PARTIALS), dict(config, BLOCK_PARTIALS=an.MAX_PARTIALS),
                        config=config))
        out.append(Case("absmax_normalize", an._absmax_one_program_kernel, f"n={n}", dtype, (dtype, dtype, n), config,
                        config=config))
        for m in (16, 2048):
            config = dq.config(m, 14336, 4096)
            out.append(Case("dequant_matmul", dq._dequant_matmul_kernel, f"M={m} N=14336 K=4096", dtype,
                            (dtype, torch.int8, dtype, dtype, m, 14336, 4096, 4096, 4096),
                            dict(config, INPUT_PRECISION="tf32"), config=config))
    config = dq.config(2048, 14336, 4096)
    out.append(Case("dequant_matmul", dq._dequant_matmul_kernel, "M=2048 N=14336 K=4096", f32,
                    (f32, torch.int8, f32, f32, 2048, 14336, 4096, 4096, 4096), dict(config, INPUT_PRECISION="ieee"),
                    config=config))
    return out


def _decode_cases(t: _Target) -> list[Case]:
    """gemv and decode_gemv, the engine's batch-1 projections."""
    gv = sys.modules["lessonlib.ops.gemv"]
    dg = sys.modules["lessonlib.ops.decode_gemv"]
    pdl, half = t.pdl, t.half
    out: list[Case] = []
    # gemv: Llama-3.2-1B's qkv projection (with a bias, as Qwen2's) and gate_up with SwiGLU, the 16-bit dtypes taking
    # turns (no shared memory: the tiles live in registers); PDL from sm_90.
    for i, (n, swiglu) in enumerate(((3072, False), (16384, True))):
        dtype = half[i % len(half)]
        config = gv.config(n // 2 if swiglu else n, 2048, swiglu)
        out.append(Case("gemv", gv._gemv_kernel, f"N={n} K=2048{' swiglu' if swiglu else ''}", dtype,
                        (dtype, dtype, dtype, dtype, n // 2 if swiglu else n, 2048, 2048, 2048),
                        dict(HAS_BIAS=not swiglu, SWIGLU=swiglu, EVEN_K=True, **pdl, **config), config=config))
    # decode_gemv at Llama-3.2-1B's sizes (32 heads, 8 KV heads, D=64): registers only, like gemv; PDL from sm_90.
    # And Qwen2.5-0.5B's qkv (14 heads, 2 KV heads, K=896 in a tile of 1024): the masked K path real checkpoints take.
    decode_shapes = (("qkv N=3072 K=2048 norm rope_kv", 1536, 2048, dg.ROPE_KV, True, 2048, 512),  # n_out: pairs
                     ("gate_up N=16384 K=2048 norm swiglu", 8192, 2048, dg.SWIGLU, True, 2048, 512),
                     ("down N=2048 K=8192 residual", 2048, 8192, dg.RESIDUAL, False, 2048, 512),
                     ("qkv N=1152 K=896 norm rope_kv masked K", 576, 896, dg.ROPE_KV, True, 896, 128))
    for i, (label, n_out, k, epilogue, norm, q_cols, kv_cols) in enumerate(decode_shapes):
        dtype = half[i % len(half)]
        config = dg.config(n_out, k, epilogue)
        out.append(Case("decode_gemv", dg._decode_gemv_kernel, label, dtype,
                        (*(dtype,) * 9, torch.int64, n_out, k, k, k, 2048, 64, 64, 1e-5, 32, q_cols, kv_cols),
                        dict(NORM=norm, HAS_BIAS=epilogue == dg.ROPE_KV, EPILOGUE=epilogue,
                             EVEN_K=k % config["BLOCK_K"] == 0, **pdl, **config), config=config))
    return out


def cases(profile: runtime.GPUProfile | None = None, thorough: bool = False) -> list[Case]:
    """The kernels to compile for ``profile``, each with its launcher's configuration for that profile. With no
    profile given, the launchers pick as they do at a launch, from ``runtime.gpu_profile()`` (in compile mode: the
    profile named by LESSONLIB_GPU_PROFILE).

    Coverage (every configuration a launcher can pick on this profile, and every dtype it accepts here):
    - flash_attention's forward, dK/dV and dQ kernels at D=64 (full) and D=128 (causal): the ladders depend on the
      head dimension only through D<=64 (D=16 and 32 take the D=64 rung, with less shared memory) and D=128; the
      masking changes no buffer. The two 16-bit dtypes (bfloat16 where the arch has it) take turns: same bytes per
      element, same configuration; flash_attention takes no float32 on a GPU.
    - paged_attention's split kernel at D=128 in every dtype (query-head groups 1, 4 and 8) and at D=256 in 16 bits:
      the configuration depends on D x element size, so D=256 in 16 bits stands for D=128 in float32's bytes per
      row too (D=256 in float32 spills 16 KB and takes minutes to compile: ``thorough=True`` adds it); its reduce
      kernel at the most splits num_splits_for can pick on this GPU (the largest tile).
    - swiglu, add_rms_norm (one pass at its widest row, and two passes), apply_rope, store_kv, rope_store_kv and
      argmax: one configuration each on every GPU, at their largest blocks, in every dtype (they compile in seconds);
      the backward kernels of swiglu and add_rms_norm and apply_rope's inverse rotation with their forward's
      configuration.
    - paged_prefill_attention at D=128 in every dtype.
    - gemv: the qkv projection (with a bias) and gate_up with SwiGLU, the 16-bit dtypes taking turns.
    - decode_gemv (Features.fused_decode_layer): its three shapes at Llama-3.2-1B's sizes, the 16-bit dtypes taking
      turns: qkv with the RMSNorm prologue, a bias and the RoPE + K/V-write epilogue; gate_up with the prologue and
      SwiGLU; down with the residual-add epilogue (o_proj is the same kernel at a smaller K); and Qwen2.5-0.5B's
      qkv, K=896: the masked-K path.
    - Lesson 01's further fusions, in the 16-bit dtypes (float32 changes no buffer of an element-wise kernel):
      bias_swiglu (swiglu's configuration), absmax_normalize's three kernels at their largest block, and
      dequant_matmul at decode (M <= 16) and prefill tiles; dequant_matmul's float32 path (an IEEE tl.dot) at the
      prefill tile, its largest.
    - On sm_90 and newer, add_rms_norm, argmax, gemv and decode_gemv with programmatic dependent launch, as launched there.
    ``thorough=True`` compiles every dtype for every case instead.
    """
    import lessonlib.ops  # noqa: F401  (defines the kernels, in the mode already chosen)
    from lessonlib.ops._common import pdl_supported

    given, profile = profile, profile or runtime.gpu_profile()  # given: None, as a launcher asks
    # Programmatic dependent launch, as the launchers use it where it is supported (pdl_options on that GPU).
    pdl = {"PDL": True, "launch_pdl": True} if pdl_supported(profile) else {}
    all_dtypes = dtypes_for(profile)
    t = _Target(profile, given, pdl, all_dtypes, tuple(d for d in all_dtypes if d.itemsize == 2), thorough)
    return [*_attention_cases(t), *_elementwise_cases(t), *_fusion_extra_cases(t), *_decode_cases(t)]


def planted_case(profile: runtime.GPUProfile) -> Case:
    """The H200's D=128 forward configuration, whatever the profile: on a GPU with less shared memory than an H200,
    a kernel that must fail the shared-memory check (tests/ops/test_compile_targets.py plants it to see it caught)."""
    fa = sys.modules["lessonlib.ops.flash_attention"]
    config = fa.forward_config(128, runtime.PROFILES["h200"])
    qs = _contiguous_strides(2, 32, 4096, 128)[:3]
    dtype = torch.float16
    return Case("flash_attention", fa._flash_attention_forward_kernel, "D=128 causal=False (planted)", dtype,
                (dtype, dtype, dtype, dtype, torch.float32, *qs * 4, 32, 4096, 4096, 128 ** -0.5),
                dict(GROUP=1, CAUSAL=False, HEAD_DIM=128, **config),
                fa.forward_shared_memory(config, 128, profile), config, planted=True)


