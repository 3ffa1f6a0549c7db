"""Recorded GPU runs: the labels benchmarks write and plots read, and the file format that carries them.

A results file is JSON::

    {
      "format": "lessonlib-results/1",
      "benchmark": "fusion",
      "command": "python -m benchmarks.bench_fusion --out ...",
      "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
                      "date": "2026-11-30T10:00:00+00:00"},
      "ceilings": {"bandwidth_gbs": ..., "matmul_tflops": ...},
      "records": [{"op": "swiglu", "impl": "lessonlib", "shape": {"T": 8192, "I": 14336}, "dtype": "bfloat16",
                   "us": 250.1, "bytes": ..., "gbps": ...}, ...],
      "notes": {...}
    }

Every peer measured in the run is a record of its own (``impl``: ``eager``, ``torch.compile``, ``copy``...).
Committed files live in ``lessonlib/results/`` so that a pip-installed lessonlib (Colab) carries them.

The labels are declared once, here (:class:`Op`, :class:`Impl`, :class:`Unit`, and :func:`sweep_label` for a
tuning sweep's settings): benchmarks write these constants, plots and notebooks read them, and a file holding a
label declared nowhere fails to load, naming the label and the file. Renaming a label means changing its value
here and re-recording (or leaving the old value in place): a plot never silently loses its bar.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from lessonlib.runtime import PRINT_WIDTH

FORMAT = "lessonlib-results/1"
RESULTS_DIR = Path(__file__).parent / "results"


def _labels(namespace) -> frozenset[str]:
    return frozenset(value for name, value in vars(namespace).items() if name.isupper())


class Benchmark:
    """The ``benchmark`` field, one per ``benchmarks/bench_<name>.py``; :func:`recorded_name` names its file."""

    FUSION = "fusion"
    FLASH_ATTENTION = "flash_attention"
    PAGED_ATTENTION = "paged_attention"
    CUDA_GRAPHS = "cuda_graphs"
    HEADLINE = "headline"
    ENGINE = "engine"
    ENGINE_QWEN = "engine_qwen"  # issue 27: bench_engine.py --qwen-shape, a Qwen2.5-0.5B-shaped model (no ladder)
    ATTENTION_LAUNCHES = "attention_launches"  # lesson 02: naive attention's kernels against one fused launch
    PAGING_PAYOFF = "paging_payoff"  # lesson 03: the largest batch that fits, contiguous slabs against blocks
    CHUNKED_PREFILL = "chunked_prefill"  # lesson 07: one long prompt arriving among decodes, chunked or not
    SERVING = "serving"  # lesson 07: OpenAI-compatible servers under Poisson traffic (benchmarks/bench_serving.py)
    FUSION_EXTRAS = "fusion_extras"  # lesson 01: bias_swiglu, dequant_matmul, absmax_normalize (a grid-wide barrier)
    PER_CALL = "per_call"  # issue 27: swiglu and add_rms_norm one call at a time, cached launch vs plain vs eager
    FLASH_ATTENTION_SCHEDULES = "flash_attention_schedules"  # lesson 02: TMA, warp specialization, persistent, atomics


# Benchmarks written but not yet run on the H200: no committed file, and the notebooks say "not recorded yet".
# The lead's GPU run adds the file; then the benchmark leaves this set (tests/test_results.py checks both ways).
AWAITING_GPU_RUN: frozenset[str] = frozenset()
# Benchmarks whose run on the CPU (plain PyTorch, no interpreter) is committed meanwhile, as recorded_name(b, "cpu").
RECORDED_ON_CPU: frozenset[str] = frozenset({Benchmark.CHUNKED_PREFILL})


def recorded_name(benchmark: str, gpu: str = "h200") -> str:
    """The committed file of a benchmark's run on a GPU: ``recorded_name(Benchmark.FUSION)`` is "fusion-h200"."""
    return f"{benchmark.replace('_', '-')}-{gpu}"


class Op:
    """What a record measured (the ``op`` field)."""

    COPY = "copy"  # a device copy of the same bytes as the op at that shape: the ceiling beside it
    SWIGLU = "swiglu"
    ADD_RMS_NORM = "add_rms_norm"
    SWIGLU_BACKWARD = "swiglu_backward"
    ADD_RMS_NORM_BACKWARD = "add_rms_norm_backward"
    LAUNCH_OVERHEAD = "launch_overhead"  # one decode-size call split into its host-side steps
    APPLY_ROPE = "apply_rope"
    GATED_MLP = "gated_mlp"
    FORWARD = "forward"  # attention forward
    BACKWARD = "backward"  # attention backward
    FORWARD_VARIANT = "forward variant"  # the benchmark's copy of the forward loop, changed one way at a time
    DECODE = "decode"  # attention of one query over a long KV sequence
    PAGED_ATTENTION = "paged_attention"
    STORE_KV = "store_kv"
    ROPE_STORE_KV = "rope_store_kv"  # RoPE on the new tokens' q and k, and the KV-cache write
    DECODE_STEP = "decode_step"  # one decoder layer's decode step
    GENERATE = "generate"
    ENGINE_STEPS = "engine_steps"
    LADDER = "tokens_per_s_ladder"  # lesson 07: the engine with each course step switched on in turn
    DECODE_STEP_PART = "decode_step_part"
    DECODE_STEP_LIMIT = "decode_step_limit"
    BATCH_1_DECODE_STEP = "batch-1 decode step"  # kernels per layer and GPU time, Features.fused_decode_layer off/on
    READ = "read"  # headline: the bandwidth a plain read reaches
    LAUNCH_BOUND_ATTENTION = "attention at launch-bound sizes"  # tiny T: launches, not bytes, are the time
    LARGEST_BATCH = "largest batch that fits"  # the same KV memory, reserved as slabs or as blocks
    STEP_TIMELINE = "step timeline"  # lesson 07: each engine step's time and which requests' tokens came out
    ABSORBED = "absorbed into attention"  # the softmax scale and dropout, inside attention's kernel or beside it
    SERVING = "online serving (Poisson arrivals)"  # TTFT, ITL, end-to-end latency and output tokens/s at a rate
    BIAS_SWIGLU = "bias_swiglu"  # silu(gate + gate_bias) * (up + up_bias)
    DEQUANT_MATMUL = "dequant_matmul"  # x @ (int8 weight * per-row scales).T
    ABSMAX_NORMALIZE = "absmax_normalize"  # x / max|x|: a reduction every output needs, across all programs


class Impl:
    """Who ran it (the ``impl`` field): lessonlib or a peer measured in the same run."""

    LESSONLIB = "lessonlib"
    EAGER = "eager"
    COMPILE = "torch.compile"
    COPY = "copy (same bytes)"
    # backward
    LESSONLIB_KERNEL = "lessonlib (kernel)"  # the gradient kernel called directly
    LESSONLIB_AUTOGRAD = "lessonlib (autograd)"  # through the op's autograd formula
    # launch_overhead: the steps of one decode-size call
    CHECK_TENSORS = "check_tensors only"
    TORCH_EMPTY = "torch.empty only"
    BARE_LAUNCH = "bare Triton launch (inputs ready)"
    OPS_SWIGLU = "lessonlib.ops.swiglu"
    SWIGLU_LAUNCHER = "swiglu_forward (the launcher alone)"
    SWIGLU_CUSTOM_OP = "torch.ops.lessonlib.swiglu (custom op dispatch)"
    EAGER_SILU_MUL = "eager silu·mul"
    OPS_ADD_RMS_NORM = "lessonlib.ops.add_rms_norm"
    ADD_RMS_NORM_LAUNCHER = "add_rms_norm_forward (the launcher alone)"
    ADD_RMS_NORM_CUSTOM_OP = "torch.ops.lessonlib.add_rms_norm (custom op dispatch)"
    # per_call: the public op through each launch path (ops/_launcher.py), and add_rms_norm's eager peer
    LESSONLIB_CACHED_LAUNCH = "lessonlib, cached launch"  # lessonlib's default path: binder skipped (_launcher.py),
    # and from the second call of one signature of inputs, validation and the key too (ops/_plans.py)
    LESSONLIB_PLAIN_LAUNCH = "lessonlib, plain kernel[grid] launch"  # Triton's JITFunction.run on every call
    EAGER_ADD_F_RMS_NORM = "eager x + r, F.rms_norm"
    # gated_mlp
    FUSED_GATED_MLP = "lessonlib (gate_up GEMM + swiglu)"
    SHARE_SWIGLU = "of which: swiglu kernel"
    SHARE_EAGER_SILU_MUL = "of which: eager silu·mul"
    COMPILE_REDUCE_OVERHEAD = "torch.compile reduce-overhead"
    CUDA_GRAPH_BY_HAND = "CUDA graph (by hand)"
    # decode_step
    EAGER_STEP = "eager PyTorch step"
    FUSED_STEP = "lessonlib fused step"
    FUSED_STEP_GRAPH = "lessonlib fused step, CUDA graph"
    # attention
    NAIVE = "naive"
    SDPA = "SDPA"  # PyTorch's own choice of backend (the CPU smoke run)
    SDPA_FLASH = "SDPA flash"
    SDPA_CUDNN = "SDPA cudnn"
    SDPA_EFFICIENT = "SDPA efficient"
    SDPA_MATH = "SDPA math"  # PyTorch's unfused attention: the score matrix (and a dropout mask) in memory
    PRESCALED_Q = "Q scaled in a pass of its own, then lessonlib"  # vs the scale folded into the kernel's exp2
    LOOP_COPY = "loop copy, unchanged"
    MATMULS_ONLY = "matrix products alone (no softmax)"
    LAZY_RESCALE = "lazy rescale (FlashAttention-4)"
    EXP2_16BIT = "exp2 in 16 bits"
    EAGER_ATTENTION = "eager: matmul, scale, mask, softmax, matmul"  # five kernels, as a model written in PyTorch
    # flash_attention_schedules: the Hopper techniques tried on lessonlib's loop (one record per tile configuration)
    TMA_DESCRIPTORS = "TMA tensor descriptors"
    TMA_WARP_SPECIALIZED = "TMA + warp specialization"
    TMA_PERSISTENT = "TMA + persistent grid"
    BACKWARD_TWO_KERNELS = "two kernels: dK/dV, then dQ"  # lessonlib's backward at the record's tiles
    BACKWARD_ATOMIC_DQ = "one kernel, dQ by float32 atomics"  # FlashAttention-2's original schedule
    # paged attention and store_kv
    TABLES_VALIDATED = "lessonlib, tables validated every call"
    SLOTS_VALIDATED = "lessonlib, slots validated every call"
    SDPA_CONTIGUOUS = "SDPA, contiguous cache"
    GATHER_THEN_SDPA = "gather pages, then SDPA"
    FLEX_PAGED = "FlexAttention paged"
    # rope_store_kv: the separate kernels it replaces (lessonlib.ops.rope_store_kv.apply_rope_then_store_kv)
    APPLY_ROPE_THEN_STORE_KV = "apply_rope + store_kv (q, k contiguous)"  # the two kernels alone
    COPIES_APPLY_ROPE_STORE_KV = "copies + apply_rope + store_kv"  # the engine's four launches from qkv's rows
    # engine
    HF_DYNAMIC = "transformers generate (dynamic cache, eager)"
    HF_STATIC = "transformers generate (static cache, compiled)"
    ENGINE = "lessonlib engine"
    ENGINE_GRAPHS = "lessonlib engine, CUDA graphs"
    ENGINE_EAGER = "lessonlib engine, eager"
    ENGINE_GRAPHS_CUBLAS = "lessonlib engine, CUDA graphs, cuBLAS projections"  # Features(gemv=False), batch 1
    ENGINE_GRAPHS_SYNC = "lessonlib engine, CUDA graphs, synchronous scheduling"  # Features(async_scheduling=False)
    ENGINE_FUSED_DECODE = "lessonlib engine, fused decode layer"  # Features(fused_decode_layer=True), batch 1
    WEIGHT_READ_LIMIT = "bytes read at copy bandwidth"
    # the tokens/s ladder's rungs (lessonlib.cases.serving_engine.ladder), cumulative
    RUNG_PLAIN = "plain PyTorch"
    RUNG_FUSED_OPS = "+ fused ops"
    RUNG_FLASH_PREFILL = "+ FlashAttention prefill"
    RUNG_PAGED_DECODE = "+ paged decode"
    RUNG_CUDA_GRAPHS = "+ CUDA graphs"
    RUNG_CONTINUOUS_BATCHING = "+ continuous batching"
    # chunked_prefill: how the scheduler fits a long prompt among running decodes (Features.chunked_prefill)
    PREFILL_FIRST = "prefill-first (whole prompt in one step)"
    CHUNKED_PREFILL = "chunked prefill (token budget shared with decodes)"
    # serving: the servers under load
    SERVER_CHUNKED_PREFILL = "lessonlib server, chunked prefill"
    SERVER_NO_CHUNKED_PREFILL = "lessonlib server, no chunked prefill"
    HF_SERVE = "transformers serve --continuous-batching"
    # paging_payoff: how the KV memory is reserved
    KV_SLABS = "contiguous slabs (max_model_len each)"
    KV_BLOCKS = "paged blocks (what is used)"
    # fusion_extras: dequant_matmul's unquantised peer, absmax_normalize's two ways around a grid-wide barrier
    LINEAR_16BIT = "F.linear on the 16-bit weight (no quantisation)"
    TWO_LAUNCHES = "lessonlib, two launches (the launch boundary is the barrier)"
    ONE_PROGRAM = "lessonlib, one program (no barrier needed)"
    # headline's read ceiling
    SUM_READ = "sum (reads every byte once)"
    COPY_READ_WRITE = "copy (reads and writes half each)"


SDPA_BACKEND_IMPLS = {"FLASH_ATTENTION": Impl.SDPA_FLASH, "CUDNN_ATTENTION": Impl.SDPA_CUDNN,
                      "EFFICIENT_ATTENTION": Impl.SDPA_EFFICIENT}  # torch's SDPBackend name -> impl


class Unit:
    """Measured fields of a record."""

    US = "us"  # microseconds per call (None: the case failed; ``error`` says why)
    GRAPH_US = "graph_us"  # the same, replayed from a CUDA graph (GPU time alone)
    US_PER_CALL = "us_per_call"
    GBPS = "gbps"  # the fewest bytes the op must move / time, 1e9 bytes per second
    GRAPH_GBPS = "graph_gbps"
    TFLOPS = "tflops"


class Regime:
    PER_CALL = "per call, back to back"  # calls in a loop, as a decode loop makes them: launch overhead included


OPS, IMPLS = _labels(Op), _labels(Impl)

# A tuning sweep's impl: "<prefix> key=value key=value ...", e.g. "lessonlib BLOCK_M=64 BLOCK_N=64 num_warps=4".
SWEEP_PREFIX = "lessonlib"
FUSION_SWEEP_PREFIX = "sweep"  # fusion's sweeps, recorded as "sweep BLOCK=1024 warps=4"
_SETTING = r"[A-Za-z_]+=\d+(?: per SM)?"
_SWEEP = re.compile(rf"^(?:{SWEEP_PREFIX}|{FUSION_SWEEP_PREFIX})(?: (?:dkdv|\| dq|{_SETTING}))*$")


def sweep_label(settings: dict, prefix: str = SWEEP_PREFIX, per: str = "") -> str:
    """The impl of one point of a tuning sweep: ``sweep_label({"num_splits": 4})`` is "lessonlib num_splits=4"."""
    return f"{prefix} " + " ".join(f"{k}={v}{per}" for k, v in settings.items())


def kernels_sweep_label(configs: dict[str, dict]) -> str:
    """A sweep point setting several kernels: "lessonlib dkdv BLOCK_M=32 ... | dq BLOCK_M=64 ..."."""
    return SWEEP_PREFIX + " " + " | ".join(f"{kernel} " + sweep_label(c, "").strip() for kernel, c in configs.items())


def is_sweep(impl: str) -> bool:
    """Whether ``impl`` is a point of a tuning sweep rather than a named implementation."""
    return impl not in IMPLS and bool(_SWEEP.match(impl)) and "=" in impl


def sweep_settings(impl: str) -> dict[str, int]:
    """The settings a one-kernel sweep point's impl names: ``{"num_splits": 8, "num_warps": 8}``."""
    return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", impl)}


class UnknownLabel(ValueError):
    """A record names an op or impl that this module does not declare."""


def check_labels(records: list[dict], where: str) -> None:
    """Raise :class:`UnknownLabel` on the first record whose op or impl is declared nowhere in this module."""
    for rec in records:
        if rec["op"] not in OPS:
            raise UnknownLabel(f"{where}: op {rec['op']!r} is not declared in lessonlib.results.Op")
        if rec["impl"] not in IMPLS and not is_sweep(rec["impl"]):
            raise UnknownLabel(f"{where}: impl {rec['impl']!r} (op {rec['op']!r}) is not declared in "
                               "lessonlib.results.Impl, nor a sweep_label")


@dataclass(frozen=True)
class Ceilings:
    """The two numbers every kernel is judged against."""

    bandwidth_gbs: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # GEMM in the course's dtype: bf16, or fp16 on a GPU without bf16 (runtime.dtype())
    source: str  # "measured live on <GPU>" or the recorded run's provenance

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which an op is compute-bound."""
        return self.matmul_tflops * 1e12 / (self.bandwidth_gbs * 1e9)


NO_GPU = "none (CPU)"  # environment()'s "gpu" where there is none; provenance() says "a CPU (no GPU)"


def environment() -> dict:
    """What a recorded run must name: the GPU, the versions, the date."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else NO_GPU,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class Results:
    benchmark: str
    command: str
    environment: dict
    ceilings: dict
    records: list
    notes: dict
    path: Path | None = None  # the file :func:`load` read it from; None for a run not saved yet

    def select(self, **where) -> list[dict]:
        """Records whose fields equal every ``where`` item; a shape key may be given directly (``T=8192``)."""
        out = []
        for rec in self.records:
            fields = {**rec.get("shape", {}), **rec}
            if all(fields.get(k) == v for k, v in where.items()):
                out.append(rec)
        return out

    def one(self, **where) -> dict:
        found = self.select(**where)
        if len(found) != 1:
            raise KeyError(f"{len(found)} records match {where} in the '{self.benchmark}' results")
        return found[0]

    def provenance(self) -> str:
        """The GPU, the versions, the date, and for a loaded file that file and the command that rewrites it. The
        recorded command names where the run wrote on its own machine (``--out /root/out/x.json``); a reader needs
        the file the numbers are read from, so a committed file is named by its path in the repository and the
        command's ``--out`` points there; ``--logs`` (where bench_serving.py put the servers' logs, on that machine)
        is left out, as the default folder serves a rerun (the rest of the command is the one that ran)."""
        env = self.environment
        where = "a CPU (no GPU)" if env["gpu"] == NO_GPU else env["gpu"]
        head = f"recorded on {where}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}"
        if self.path is None:
            return f"{head}; command: {self.command}"
        path = Path(self.path).resolve()
        file = f"lessonlib/results/{path.name}" if path.parent == RESULTS_DIR.resolve() else str(self.path)
        command = re.sub(r"--out(=|\s+)\S+", lambda _: f"--out {file}", self.command)
        command = re.sub(r"\s+--logs(=|\s+)\S+", "", command)
        return f"{head}; file: {file}; rerun: {command}"

    def recorded_ceilings(self) -> Ceilings:
        return Ceilings(self.ceilings["bandwidth_gbs"], self.ceilings["matmul_tflops"], self.provenance())

    def to_json(self) -> dict:
        return {"format": FORMAT, "benchmark": self.benchmark, "command": self.command,
                "environment": self.environment, "ceilings": self.ceilings, "records": self.records,
                "notes": self.notes}

    def save(self, path) -> Path:
        path = Path(path)
        check_labels(self.records, str(path))
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def load(name_or_path) -> Results:
    """A committed results file by name (``load("fusion-h200")``) or any path; an undeclared label fails."""
    path = Path(name_or_path)
    if not path.suffix:
        path = RESULTS_DIR / f"{name_or_path}.json"
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format={data.get('format')!r})")
    check_labels(data["records"], str(path))
    return Results(data["benchmark"], data["command"], data["environment"], data["ceilings"], data["records"],
                   data.get("notes", {}), path)


def find(name: str) -> Results | None:
    """A committed results file by name, or None when that benchmark has not been recorded yet."""
    return load(name) if (RESULTS_DIR / f"{name}.json").exists() else None


def recorded_ceilings(name: str = "fusion-h200") -> Ceilings:
    """The ceilings measured in a recorded run: what a CPU-only notebook plots against."""
    return load(name).recorded_ceilings()


def wrapped(line: str) -> str:
    """A provenance line to print ("recorded run: " + ``provenance()``), in lines of at most PRINT_WIDTH broken
    between words (a path or a number stays whole) and indented after the first: JupyterLab breaks anywhere."""
    return textwrap.fill(line, PRINT_WIDTH, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
