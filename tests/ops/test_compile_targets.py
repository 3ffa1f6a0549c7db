"""Every kernel compiles for every GPU architecture the course supports, with the configuration its launcher picks
there, and asks for no more shared memory than that architecture has. No GPU needed: Triton compiles for a named
target (``GPUTarget``) through a stand-in driver (tools/compile_targets.py).

What is compiled (the docstring of ``tools/compile_targets.cases`` has the details): for each profile in
``PROFILES`` (T4 sm_75, A100 sm_80, A10 sm_86, L4 sm_89, H200 sm_90, G4 sm_120), every configuration a launcher can pick there:
FlashAttention's forward, dK/dV and dQ kernels at D=64 and D=128, paged attention's split kernel at D=128 in every
dtype (query-head groups 1, 4, 8) and at D=256, and its reduce kernel at the most splits the GPU can get, and the fused element-wise ops at their largest blocks. Every dtype the
architecture supports appears (no bfloat16 on sm_75); float16 and bfloat16 take turns where the configuration is the
same (same bytes per element, the same shared memory).

Twice: under the Triton installed here (CI: the newest, ``make setup``) and under Colab's, the one students compile
with (pyproject.toml's ``[tool.course.tested] colab_triton``, 3.6.0), which ``make setup`` puts in ``.triton-colab/``
(only the triton package, with --no-deps: torch and everything else are this environment's). A kernel that one of
them cannot compile, or compiles to more shared memory than the architecture has, fails here, not on a student's
GPU. Without ``.triton-colab/`` those cases skip, saying so (in CI, where ``make setup`` made it, they fail).

Each profile compiles in its own process (``LESSONLIB_MODE=compile``: kernels defined for the compiler while this
test process runs the interpreter), with the profile named by ``LESSONLIB_GPU_PROFILE``, so the configurations come
from the launchers' own ``runtime.gpu_profile()`` path, as they would on that GPU or under emulation. Compiled
kernels are kept between runs in the user's cache folder (:func:`compile_cache`), outside the checkout: a fresh clone
on the same machine (CI's, a developer's) compiles only the kernels that changed. Triton's cache key covers the
kernel's source and every function it calls, the constants and options, the target, the Triton build (its version and
its compiler's own files, ptxas included) and the environment variables that change a compile, so a kept entry stands
only for an identical compile: a rerun checks the same shared memory on the same cubin. A cold cache (a new machine)
takes about twelve minutes of CPU here (six of wall time on two cores); a warm one, about one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lessonlib import runtime
import lessonlib.ops  # noqa: F401  (defines the op modules, whose config functions the tests ask)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "compile_targets.py"
TARGETS = ("t4", "a100", "a10", "l4", "h200", "g4")  # sm_75, sm_80, sm_86, sm_89, sm_90, sm_120
COLAB_TRITON = ROOT / ".triton-colab"  # tools/setup.sh installs Colab's Triton there
TRITONS = ("installed", "colab")
PLANTED_ON = "l4"  # the H200's D=128 forward tiles compiled for sm_89: 160 KB against 99 KB

try:
    from triton.backends import backends as _triton_backends
    from triton.backends.compiler import GPUTarget  # noqa: F401
    from triton.backends.driver import DriverBase  # noqa: F401

    _MISSING = None if "nvidia" in _triton_backends else "this Triton has no NVIDIA backend"
except ImportError as error:  # an older Triton without the stand-in driver's API
    _MISSING = f"this Triton cannot compile for a named target without a GPU ({error})"

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"compile-for-target: {_MISSING}")


def _ops_module(name):
    return sys.modules[f"lessonlib.ops.{name}"]


def colab_triton_version() -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
        import pip._vendor.tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["course"]["tested"]["colab_triton"]


def _colab_triton_missing() -> str | None:
    """Why Colab's Triton cannot be used here, or None."""
    wanted = colab_triton_version()
    if not (COLAB_TRITON / f"triton-{wanted}.dist-info").is_dir():
        return f"Colab's Triton {wanted} is not in {COLAB_TRITON.name}/ (`make setup` installs it there)"
    return None


KEEP_DAYS = 30  # a kept compile not written for this long is dropped (Triton's cache never shrinks by itself)


def compile_cache() -> Path:
    """Where the compiled kernels are kept between runs: ``$XDG_CACHE_HOME/lessonlib/triton-compile-targets`` (by
    default under ``~/.cache``). Only each kernel's binary and metadata are kept (``TRITON_STORE_BINARY_ONLY``:
    about a tenth of the bytes); entries older than ``KEEP_DAYS`` are removed when the test starts."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lessonlib" / "triton-compile-targets"


def drop_old_entries(cache: Path, days: float = KEEP_DAYS) -> int:
    """Remove the cache's entries (one folder per compiled kernel) last written more than ``days`` ago; how many."""
    if not cache.is_dir():
        return 0
    cutoff, dropped = time.time() - days * 86400, 0
    for entry in cache.iterdir():
        if entry.is_dir() and entry.stat().st_mtime < cutoff:
            shutil.rmtree(entry, ignore_errors=True)
            dropped += 1
    return dropped


def _compile(profile: str, triton: str = "installed", *extra: str) -> list[dict]:
    """The tool's records for ``profile``, compiled in a process of its own under this environment's Triton or
    (``triton="colab"``) under Colab's, put first on the path."""
    path = [str(COLAB_TRITON)] if triton == "colab" else []
    env = dict(os.environ, LESSONLIB_MODE="compile", LESSONLIB_GPU_PROFILE=profile,
               PYTHONPATH=os.pathsep.join([*path, str(ROOT)]),
               TRITON_CACHE_DIR=str(compile_cache()), TRITON_STORE_BINARY_ONLY="1")
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is the default it keeps
    run = subprocess.run([sys.executable, str(TOOL), "--json", *extra], capture_output=True, text=True, env=env,
                         timeout=1200)
    assert run.returncode == 0, (f"compiling for {profile} under {triton} Triton failed:\n{run.stdout[-3000:]}\n"
                                 f"{run.stderr[-5000:]}")
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], list[dict]]:
    """Records of every compiled kernel, by (Triton, profile). Two processes at a time: CI has two cores."""
    tritons = [t for t in TRITONS if t != "colab" or _colab_triton_missing() is None]
    jobs = [(triton, profile) for triton in tritons for profile in TARGETS]
    drop_old_entries(compile_cache())
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda job: _compile(job[1], job[0], *(("--plant",) if job[1] == PLANTED_ON else ())),
                           jobs)
        return dict(zip(jobs, results))


@pytest.fixture(params=TRITONS)
def triton_build(request) -> str:
    """Which Triton compiled: this environment's, or Colab's (skipped without .triton-colab/, failed in CI)."""
    if request.param == "colab" and (missing := _colab_triton_missing()):
        if os.environ.get("CI"):
            pytest.fail(f"{missing}: CI must compile under the students' Triton")
        pytest.skip(missing)
    return request.param


def over_the_limit(records: list[dict]) -> list[str]:
    """Each compiled kernel whose shared memory exceeds its architecture's limit, or its launcher's estimate (the
    estimate is what the launcher's choice rests on: it must bound the compiled kernel)."""
    problems = []
    for r in records:
        where = f"sm_{r['arch']} {r['kernel']} {r['label']} {r['dtype']} {r['config']}"
        if r["shared"] > r["limit"]:
            problems.append(f"{where}: needs {r['shared']} B of shared memory, the limit is {r['limit']}")
        if r["estimate"] is not None and r["shared"] > r["estimate"]:
            problems.append(f"{where}: needs {r['shared']} B, more than the launcher's estimate {r['estimate']}")
    return problems


def print_table(records: list[dict]) -> None:
    for r in records:
        config = " ".join(f"{k}={v}" for k, v in r["config"].items())
        print(f"sm_{r['arch']} {r['kernel']:<32} {r['label']:<20} {r['dtype']:<8} {config:<58} "
              f"{r['shared'] / 1024:6.1f} KB (limit {r['limit'] // 1024}, estimate "
              f"{'-' if r['estimate'] is None else round(r['estimate'] / 1024, 1)}) {r['seconds']}s")


@pytest.mark.parametrize("profile", TARGETS)
def test_every_kernel_fits_its_architecture(compiled, triton_build, profile):
    records = [r for r in compiled[triton_build, profile] if not r.get("planted")]
    print_table(records)  # the table of configurations and compiled shared memory (pytest -s)
    expected = runtime.PROFILES[profile]
    assert {r["arch"] for r in records} == {expected.arch}
    import triton

    version = triton.__version__ if triton_build == "installed" else colab_triton_version()
    assert {r["triton"] for r in records} == {version}  # the Triton asked for compiled them
    assert over_the_limit(records) == []


@pytest.mark.parametrize("profile", TARGETS)
def test_every_kernel_and_dtype_is_compiled(compiled, triton_build, profile):
    records = [r for r in compiled[triton_build, profile] if not r.get("planted")]
    kernels = {name for module in ("flash_attention", "paged_attention", "paged_prefill_attention", "swiglu",
                                   "add_rms_norm", "apply_rope", "store_kv", "rope_store_kv", "argmax", "gemv",
                                   "decode_gemv", "bias_swiglu", "dequant_matmul", "absmax_normalize")
               for name in vars(_ops_module(module)) if name.startswith("_") and name.endswith("_kernel")}
    assert {r["kernel"] for r in records} == kernels  # a new kernel needs a case in tools/compile_targets.py
    wanted = {str(d).removeprefix("torch.") for d in (torch.float32, torch.float16, torch.bfloat16)
              if d is not torch.bfloat16 or runtime.PROFILES[profile].has_bfloat16}
    assert {r["dtype"] for r in records} == wanted
    for kernel in kernels:  # every 16-bit dtype of this arch, for every kernel
        assert {r["dtype"] for r in records if r["kernel"] == kernel} >= wanted - {"float32"}, kernel


@pytest.mark.parametrize("profile", TARGETS)
def test_the_compiled_configuration_is_the_launchers_choice_for_the_profile(compiled, triton_build, profile):
    """The subprocess picked its configurations through runtime.gpu_profile() from LESSONLIB_GPU_PROFILE (as
    emulation does on a bigger GPU); here the same functions are asked with the profile given explicitly."""
    fa, pa = _ops_module("flash_attention"), _ops_module("paged_attention")
    target = runtime.PROFILES[profile]
    for r in compiled[triton_build, profile]:
        if r.get("planted"):
            continue
        head_dim = int(r["label"].split("D=")[1].split()[0]) if "D=" in r["label"] else None
        if r["kernel"] == "_flash_attention_forward_kernel":
            assert r["config"] == fa.forward_config(head_dim, target)
        elif r["kernel"] == "_flash_attention_dkdv_kernel":
            assert r["config"] == fa.backward_config(head_dim, target)["dkdv"]
        elif r["kernel"] == "_flash_attention_dq_kernel":
            assert r["config"] == fa.backward_config(head_dim, target)["dq"]
        elif r["kernel"] == "_paged_attention_split_kernel":
            group = int(r["label"].split("GROUP=")[1])
            assert r["config"] == pa.split_config(head_dim, 16, group, getattr(torch, r["dtype"]), target)


def test_a_planted_oversized_configuration_is_caught(compiled, triton_build):
    """The H200's D=128 forward tiles, forced onto sm_89: the check must flag exactly that kernel (so the assertion
    above can fail), and the launcher's own choice there must differ from it."""
    planted = [r for r in compiled[triton_build, PLANTED_ON] if r.get("planted")]
    assert len(planted) == 1
    problems = over_the_limit(planted)
    assert len(problems) == 1 and "the limit is" in problems[0], problems
    assert planted[0]["config"] != _ops_module("flash_attention").forward_config(128, runtime.PROFILES[PLANTED_ON])


def test_hopper_keeps_the_h200_tuned_configurations():
    """Nothing of the H200's speed is lost: on sm_90 the launchers pick exactly the configurations tuned there."""
    fa, pa = _ops_module("flash_attention"), _ops_module("paged_attention")
    for name in ("h100", "h200"):
        hopper = runtime.PROFILES[name]
        assert fa.forward_config(128, hopper) == dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
        assert fa.forward_config(64, hopper) == dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
        assert fa.backward_config(128, hopper) == {"dkdv": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
                                                    "dq": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for head_dim in (64, 128, 256):
                for group in (1, 4, 8):
                    assert pa.split_config(head_dim, 16, group, dtype, hopper) == dict(PAGES_PER_STEP=4, num_warps=4)


def test_emulation_drives_the_launchers_choice(monkeypatch):
    """With LESSONLIB_GPU_PROFILE=t4 on a big GPU, runtime.gpu_profile() is the T4's profile (tests/test_runtime.py
    checks that), and the launchers' default configurations follow it."""
    fa, pa = _ops_module("flash_attention"), _ops_module("paged_attention")
    t4 = runtime.PROFILES["t4"]
    monkeypatch.setattr(runtime, "gpu_profile", lambda: t4)
    assert fa.forward_config(128) == fa.forward_config(128, t4) != fa.forward_config(128, runtime.PROFILES["h200"])
    assert fa.backward_config(128) == fa.backward_config(128, t4)
    assert pa.split_config(128, 16, 4, torch.float32) == pa.split_config(128, 16, 4, torch.float32, t4)


def test_a_shape_no_configuration_fits_is_refused_before_launch():
    """paged_attention with 128-token cache blocks at D=256 in float32: one block's K and V alone are 256 KB, more
    than any GPU's shared memory per block. A clear error, not an out-of-resource failure at launch."""
    with pytest.raises(ValueError, match="no configuration fits"):
        _ops_module("paged_attention").split_config(256, 128, 8, torch.float32, runtime.PROFILES["h200"])


def test_compile_mode_defines_kernels_for_the_compiler_and_launches_nothing():
    script = (
        "import torch\n"
        "from lessonlib import runtime, ops\n"
        "import sys\n"
        "module = sys.modules['lessonlib.ops.swiglu']\n"
        "assert runtime.mode() == 'compile' and not runtime.on_gpu()\n"
        "assert runtime.gpu_profile() == runtime.PROFILES['t4'], runtime.gpu_profile()\n"
        "assert type(module._swiglu_kernel).__name__ == 'JITFunction'\n"
        "try:\n"
        "    ops.swiglu(torch.ones(2, 4), torch.ones(2, 4))\n"
        "except RuntimeError as error:\n"
        "    assert 'nothing launches' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('a launch in compile mode did not fail')\n"
        "print(runtime.describe())\n"
    )
    env = dict(os.environ, LESSONLIB_MODE="compile", LESSONLIB_GPU_PROFILE="t4", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compile only" in run.stdout and "Tesla T4" in run.stdout


def test_old_cache_entries_are_dropped_and_recent_ones_kept(tmp_path):
    old, recent = tmp_path / "old", tmp_path / "recent"
    for entry in (old, recent):
        entry.mkdir()
        (entry / "kernel.json").write_text("{}")
    long_ago = time.time() - (KEEP_DAYS + 1) * 86400
    os.utime(old, (long_ago, long_ago))
    assert drop_old_entries(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recent"]
    assert drop_old_entries(tmp_path / "missing") == 0
