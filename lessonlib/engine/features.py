"""The engine's speed-ups, one switch each (lesson 07's tokens/s ladder:
:func:`lessonlib.cases.serving_engine.ladder`). Everything on is the engine's default (but chunked_prefill, a
scheduling choice lesson 07 compares, not a rung, and fused_decode_layer: it acts at batch 1 only, which the
ladder's 32-seat workload hardly reaches; bench_engine.py measures it, faster on the H200, and it stays off until
the engine's recorded runs and the GPU suite are redone with it on, so that what lesson 07 prints is the default's);
a switch turned off runs that part the plain-PyTorch way, so every combination gives the same greedy tokens in
float32 (in 16 bits each sums in its own order, so they agree up to near-ties).

    fused_ops            lessonlib's add_rms_norm, rope_store_kv, swiglu (and argmax on a GPU); off: the references
                         in lessonlib.reference (RoPE and the K/V write by tensor indexing, silu(gate) * up)
    flash_prefill        prefill attention by lessonlib's flash_attention (paged_prefill_attention after a cached
                         prefix); off: PyTorch's SDPA, causal, on the new tokens' own K/V (after a cached prefix:
                         reference.paged_prefill_attention, its pages gathered, then attention with the end-aligned
                         causal mask)
    paged_decode         decode attention by lessonlib's paged_attention; off: each sequence's pages gathered into
                         contiguous K/V, then SDPA with the padding masked (lesson 03's "gather pages, then SDPA")
    gemv                 a lone token's projections (batch-1 decode, the logits of a lone prompt's last token) by
                         lessonlib's gemv: SwiGLU in gate_up's epilogue, each product's weights read while the kernel
                         before it ends (PDL, Hopper); off: cuBLAS (then swiglu). The ladder turns it on with fused_ops
    fused_decode_layer   a batch-1 decode step in six kernels per layer (ops.decode_gemv): qkv with the RMSNorm in its
                         prologue and RoPE + the K/V write in its epilogue, paged attention (split + reduce), o and
                         down adding into the residual stream in place, gate_up with the RMSNorm prologue and SwiGLU;
                         off: nine (add_rms_norm, rope_store_kv and the norm before gate_up on their own). It fuses
                         the kernels of fused_ops and gemv, so it acts only where both are on too (a switch turned
                         off keeps its plain way). Not for Qwen3 (q/k norm between the product and RoPE): it keeps
                         the unfused path
    cuda_graphs          decode steps, and the prefill of a lone prompt, replayed from CUDA graphs (a GPU only); off:
                         eager
    continuous_batching  admission at every step boundary; off: static batching, a batch runs to completion before
                         the next is admitted
    async_scheduling     a greedy decode step runs on the GPU while the host schedules and launches the next one
                         (its input tokens taken on the GPU from the step before); off: the host waits for each
                         step's tokens before it schedules the next. The ladder turns it on with cuda_graphs
    chunked_prefill      each step packs the running decodes first, then prompt chunks up to max_num_batched_tokens,
                         all in one mixed step (vLLM V1, Sarathi-Serve); off: prefill-first, a step admits and
                         prefills whole prompts while every decode waits. Off by default, so the ladder's recorded
                         runs keep their schedule; lesson 07 turns it on to compare the two
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Features:
    fused_ops: bool = True
    flash_prefill: bool = True
    paged_decode: bool = True
    cuda_graphs: bool = True
    continuous_batching: bool = True
    gemv: bool = True
    async_scheduling: bool = True
    chunked_prefill: bool = False
    fused_decode_layer: bool = False  # see the module's docstring

    @property
    def fuses_decode_layer(self) -> bool:
        """Whether a batch-1 decode step runs fused: fused_decode_layer, with the fused ops and gemv it builds on."""
        return self.fused_decode_layer and self.fused_ops and self.gemv

    def __post_init__(self):
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"Features.{f.name} must be a bool, got {getattr(self, f.name)!r}")


PLAIN_PYTORCH = Features(**{f.name: False for f in fields(Features)})
