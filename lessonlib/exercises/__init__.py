"""Checkers for the exercises. Each takes the student's function, runs it on fresh random inputs of several odd
shapes and every dtype this mode supports, with outputs poisoned (NaN) first, and either prints one line of success
or raises :class:`ExerciseFailed` with a message that says what to fix.

The notebooks also run these checkers on lessonlib's own kernels, so a broken library kernel fails a notebook loudly.

One module per lesson; every checker and launcher is re-exported here (``exercises.check_x(...)``,
``from lessonlib.exercises import check_x``), which is how notebooks, tests and the grader call them:

* :mod:`~lessonlib.exercises.triton_basics` (00, the Triton on-ramp) and :mod:`~lessonlib.exercises.addresses` (its
  address figure's data), :mod:`~lessonlib.exercises.operator_fusion` (01),
  :mod:`~lessonlib.exercises.flash_attention` and :mod:`~lessonlib.exercises.flash_backward` (02),
  :mod:`~lessonlib.exercises.paged_attention` and :mod:`~lessonlib.exercises.rope_store_kv` (03),
  :mod:`~lessonlib.exercises.torch_compile` (04), :mod:`~lessonlib.exercises.cuda_graphs` (05),
  :mod:`~lessonlib.exercises.vllm_blocks` (06), :mod:`~lessonlib.exercises.serving_engine` (07);
  :mod:`~lessonlib.exercises.predictions`: the "predict, then measure" items of 01, 02, 03 and 05 (one checker);
* :mod:`~lessonlib.exercises._checking`: what they share (:class:`ExerciseFailed`; :func:`reported`, which shows
  it in a student copy without stopping "Run all"; poisoned calls, the tolerance check, the diagnosis of known
  kernel mistakes);
* :mod:`~lessonlib.exercises._observe` (with :mod:`~lessonlib.exercises._recording`): the one way a student's
  kernel is launched, certified and observed: every load and store recorded in the interpreter, an access outside
  its tensor named and never performed, the outputs compared certified to hold what the kernel's stores wrote;
* :mod:`~lessonlib.exercises._guards`: the guard zones every kernel exercise's tensors sit in on a GPU, so that a
  missing mask is named instead of corrupting memory, and :meth:`~lessonlib.exercises._guards.Guards.launch`.
"""

from lessonlib.exercises._checking import ExerciseFailed, reported
from lessonlib.exercises.cuda_graphs import (GRAPH_SAFE_STEPS, check_graph_safe_decode_step,
                                             check_refresh_static_inputs, eager_decode_step)
from lessonlib.exercises.flash_attention import (FLASH_FORWARD_CASES, check_flash_attention, check_flash_forward_kernel,
                                                 check_key_tile_bound, check_online_softmax_update, flash_forward,
                                                 flash_forward_config)
from lessonlib.exercises.flash_backward import FLASH_DKDV_CASES, check_flash_dkdv_kernel, flash_dkdv
from lessonlib.exercises.operator_fusion import (ADD_RMS_NORM_SHAPES, SWIGLU_SHAPES, add_rms_norm, check_add_rms_norm,
                                                 check_apply_rope, check_fused_backward, check_swiglu, swiglu)
from lessonlib.exercises.paged_attention import (PAGED_DECODE_CASES, check_free_sequence, check_paged_decode_kernel,
                                                 check_physical_slot, paged_decode)
from lessonlib.exercises.predictions import (check_causal_speedup, check_gather_ratio, check_graph_saving,
                                             check_swiglu_ratio)
from lessonlib.exercises.rope_store_kv import (ROPE_CASES, ROPE_STORE_KV_CASES, check_rope_kernel,
                                               check_rope_store_kv_kernel, rope, rope_store_kv, rope_store_kv_bytes)
from lessonlib.exercises.serving_engine import check_can_admit, check_prompt_chunks, check_top_p_filter
from lessonlib.exercises.torch_compile import check_no_graph_break
from lessonlib.exercises.addresses import program_owners
from lessonlib.exercises.triton_basics import (check_row_sum_kernel, check_scale_add_kernel, check_transpose_kernel,
                                               row_sum, scale_add, transpose)
from lessonlib.exercises.vllm_blocks import check_blocks_needed

__all__ = ["ADD_RMS_NORM_SHAPES", "ExerciseFailed", "FLASH_DKDV_CASES", "FLASH_FORWARD_CASES", "GRAPH_SAFE_STEPS",
           "PAGED_DECODE_CASES", "ROPE_CASES", "ROPE_STORE_KV_CASES", "SWIGLU_SHAPES", "add_rms_norm",
           "check_add_rms_norm", "check_apply_rope", "check_blocks_needed", "check_can_admit", "check_causal_speedup",
           "check_flash_attention", "check_flash_dkdv_kernel", "check_flash_forward_kernel", "check_free_sequence",
           "check_fused_backward", "check_gather_ratio", "check_graph_safe_decode_step", "check_graph_saving",
           "check_key_tile_bound", "check_no_graph_break", "check_online_softmax_update", "check_paged_decode_kernel",
           "check_physical_slot", "check_prompt_chunks",
           "check_refresh_static_inputs", "check_rope_kernel", "check_rope_store_kv_kernel",
           "check_row_sum_kernel", "check_scale_add_kernel", "check_swiglu", "check_swiglu_ratio",
           "check_top_p_filter", "check_transpose_kernel", "eager_decode_step", "flash_dkdv", "flash_forward",
           "flash_forward_config", "paged_decode", "program_owners", "reported", "rope", "rope_store_kv",
           "rope_store_kv_bytes", "row_sum", "scale_add", "swiglu", "transpose"]
