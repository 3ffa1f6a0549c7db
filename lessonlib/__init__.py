"""lessonlib: the helper package of the course "Fast Attention Kernels & Operator Fusion".

The map (one line per module; ``tests/test_code_shape.py`` holds it to the folder):

* ``lessonlib.runtime``: where kernels run (GPU, or Triton's interpreter on CPU), the GPU profile, problem sizes.
* ``lessonlib._interpreter``: Triton's interpreter without its repeated re-patching cost (used by ``runtime``).
* ``lessonlib.reference``: plain-PyTorch definitions of every op (no Triton).
* ``lessonlib.ops``: the same ops as fused Triton kernels, one op per file.
* ``lessonlib.sdpa``, ``lessonlib.flex_paged``: PyTorch's SDPA on chosen backends; paged decode through FlexAttention.
* ``lessonlib.kv_cache``, ``lessonlib.kv_memory``: paged KV-cache bookkeeping; KV memory reserved against used.
* ``lessonlib.decoder``, ``lessonlib.cuda_graphs``: lesson 05's decoder layer step, and capture and replay.
* ``lessonlib.compiler``: inside torch.compile (lesson 04).
* ``lessonlib.traffic``: the bytes-and-FLOPs model of each op, eager chain against fused.
* ``lessonlib.measure``, ``lessonlib.measured``: timing and launch counts; lesson 01's ops timed live beside the
  recorded run.
* ``lessonlib.bench``, ``lessonlib.cases``, ``lessonlib.results``: the benchmark harness, the timed cases the
  benchmarks and the live views share, the results format; ``results/`` holds the recorded GPU runs.
* ``lessonlib.plots``, ``lessonlib.widgets``: figures and interactive views for the notebooks.
* ``lessonlib.claims``: the source texts' measurable claims, each with its computed verdict (lesson 05).
* ``lessonlib.exercises``, ``lessonlib.hints``, ``lessonlib.grading``: the exercises' checkers, their hints, and the
  grader.
* ``lessonlib.engine``: lesson 07's serving engine (and its OpenAI-compatible server, ``engine.serve``).
* ``lessonlib.serving``, ``lessonlib.tiny_model``: lesson 06's bridge to vLLM; tiny models built with nothing
  downloaded.
* ``lessonlib.testing``: checking a fast kernel against its reference (tests and checkers alike).
* ``lessonlib.install``: what lesson 06's set-up cell installs (imports no torch).

Importing ``lessonlib`` imports nothing else: no Triton, so it never locks the wrong runtime mode, and no torch, so
lesson 06's set-up cell can install vLLM (which replaces torch) through ``lessonlib.install`` before torch is loaded.
``describe``, ``device``, ``gpu_only``, ``mode`` and ``pick`` come from :mod:`lessonlib.runtime` on first use, and
``lessonlib.<module>`` imports that module on first use.
"""

import importlib
import inspect
import sys

__version__ = "0.2.0"  # = pyproject.toml's [project] version (tests/test_course_links.py checks)
__all__ = ["describe", "device", "gpu_only", "mode", "pick", "source"]
_FROM_RUNTIME = {"describe", "device", "gpu_only", "mode", "pick"}


def __getattr__(name: str):
    if name in _FROM_RUNTIME:
        from lessonlib import runtime

        return getattr(runtime, name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise  # the module exists and failed to import something else: say that, not "no attribute"
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def source(obj, *names: str) -> str:
    """Library code as a lesson shows it. ``source(obj)``: the whole file that defines ``obj`` (or the module
    itself). ``source(obj, "name", ...)``: only those top-level functions and classes of that file, each whole with
    its decorators and separated by a blank line, in the order asked: the kernel and the lines the idea needs,
    without the launch plumbing around them. Notebooks print this rather than copying library code."""
    module = sys.modules[obj.__module__] if not inspect.ismodule(obj) else obj
    text = inspect.getsource(module)
    if not names:
        return text
    import ast

    lines = text.splitlines()
    found = {node.name: node for node in ast.parse(text).body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"{module.__name__} defines no top-level {', '.join(missing)} "
                         f"(it defines: {', '.join(found)})")
    pieces = []
    for name in names:
        node = found[name]
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        pieces.append("\n".join(lines[start:node.end_lineno]))
    return "\n\n\n".join(pieces) + "\n"
