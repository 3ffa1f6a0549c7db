"""Fused Triton kernels, one op per file, each with the signature of its twin in ``lessonlib.reference``.

Importing this package decides the runtime mode first (GPU or Triton's interpreter), then defines the kernels.

Names every kernel follows:
- A stride argument is ``stride_`` + the tensor + the dimension, as in Triton's tutorials and flash-attention's
  Triton kernels: ``stride_qm`` is q's stride between query rows. Letters run together (``stride_qb``,
  ``stride_kn``, ``stride_dob`` for dO); a tensor or dimension named by a word takes an underscore
  (``stride_gate_row``, ``stride_cache_token``). Dimensions: b batch, h head, t token, m query row, n key row.
- ``BLOCK_*`` constexprs are tiles (elements or rows a program handles at once); the tokens of one paged-cache block
  are ``PAGE_SIZE`` (the launchers keep vLLM's ``block_size``).
"""

from lessonlib import runtime

runtime.mode()  # must run before any @triton.jit below: Triton reads TRITON_INTERPRET at kernel definition

from lessonlib.ops.absmax_normalize import absmax_normalize  # noqa: E402
from lessonlib.ops.add_rms_norm import add_rms_norm  # noqa: E402
from lessonlib.ops.apply_rope import apply_rope  # noqa: E402
from lessonlib.ops.argmax import argmax  # noqa: E402
from lessonlib.ops.bias_swiglu import bias_swiglu  # noqa: E402
from lessonlib.ops.decode_gemv import decode_gemv, decode_qkv_rope_store_kv  # noqa: E402
from lessonlib.ops.dequant_matmul import dequant_matmul  # noqa: E402
from lessonlib.ops.flash_attention import flash_attention  # noqa: E402
from lessonlib.ops.gated_mlp import FusedGatedMLP  # noqa: E402
from lessonlib.ops.gemv import gemv  # noqa: E402
from lessonlib.ops.paged_attention import paged_attention  # noqa: E402
from lessonlib.ops.paged_prefill_attention import paged_prefill_attention  # noqa: E402
from lessonlib.ops.rope_store_kv import rope_store_kv  # noqa: E402
from lessonlib.ops.store_kv import store_kv  # noqa: E402
from lessonlib.ops.swiglu import swiglu  # noqa: E402

__all__ = ["absmax_normalize", "add_rms_norm", "apply_rope", "argmax", "bias_swiglu", "decode_gemv",
           "decode_qkv_rope_store_kv", "dequant_matmul", "flash_attention", "gemv", "paged_attention",
           "paged_prefill_attention", "rope_store_kv", "store_kv", "swiglu", "FusedGatedMLP"]
