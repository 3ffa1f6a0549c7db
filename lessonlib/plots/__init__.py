"""Figures the notebooks call instead of pasting plotting code (``import lessonlib.plots as plots``; ``plots.X``).
Each returns the matplotlib Figure. One module per lesson; :mod:`lessonlib.plots._figure` holds what they share:
the set-up, the provenance footnote (recorded GPU results always carry their GPU, versions, date and command, so a
figure shown on a laptop never passes for a live measurement) and one colour per implementation.
"""

from lessonlib.plots._figure import IMPL_COLORS, figure, finish
from lessonlib.plots.cuda_graphs import decode_step_times, launch_modes
from lessonlib.plots.flash_attention import (FORWARD_BUDGET, attention_speed, forward_time_budget,
                                             launch_bound_attention, online_softmax, score_bytes, tile_plan_grid)
from lessonlib.plots.fusion import (bandwidth, gated_mlp, launch_counts, launch_overhead, per_call_time,
                                    register_pressure, traffic_bars)
from lessonlib.plots.recorded import recorded_vs_live
from lessonlib.plots.paged_attention import block_tables, kv_reservation, paged_attention_speed, paging_payoff
from lessonlib.plots.roofline import roofline
from lessonlib.plots.serving_engine import chunked_prefill_timeline
from lessonlib.plots.serving import serving_latency, serving_summary
from lessonlib.plots.triton_basics import program_map

__all__ = ["IMPL_COLORS", "FORWARD_BUDGET", "attention_speed", "bandwidth", "block_tables", "chunked_prefill_timeline",
           "decode_step_times",
           "figure", "finish", "forward_time_budget", "gated_mlp", "kv_reservation", "launch_bound_attention",
           "launch_counts", "launch_modes", "launch_overhead", "online_softmax", "paged_attention_speed",
           "paging_payoff", "per_call_time", "program_map", "recorded_vs_live", "register_pressure", "roofline",
           "score_bytes", "serving_latency", "serving_summary", "tile_plan_grid", "traffic_bars"]
