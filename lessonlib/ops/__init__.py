"""Fused Triton kernels, one op per file, each with the signature of its twin in ``lessonlib.reference``.

Importing this package decides the runtime mode first (GPU or Triton's interpreter), then defines the kernels.
"""

from lessonlib import runtime

runtime.mode()  # must run before any @triton.jit below: Triton reads TRITON_INTERPRET at kernel definition

from lessonlib.ops.add_rms_norm import add_rms_norm  # noqa: E402
from lessonlib.ops.apply_rope import apply_rope  # noqa: E402
from lessonlib.ops.flash_attention import flash_attention  # noqa: E402
from lessonlib.ops.gated_mlp import FusedGatedMLP  # noqa: E402
from lessonlib.ops.paged_attention import paged_attention  # noqa: E402
from lessonlib.ops.paged_prefill_attention import paged_prefill_attention  # noqa: E402
from lessonlib.ops.store_kv import store_kv  # noqa: E402
from lessonlib.ops.swiglu import swiglu  # noqa: E402

__all__ = ["add_rms_norm", "apply_rope", "flash_attention", "paged_attention", "paged_prefill_attention", "store_kv", "swiglu", "FusedGatedMLP"]
