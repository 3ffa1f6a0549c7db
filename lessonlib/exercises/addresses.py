"""Which program touched which address: the data of lesson 00's figure (``plots.program_map``), measured on the
student's kernels of puzzles 1 and 2 (:mod:`~lessonlib.exercises.triton_basics`), not drawn by hand.

In the interpreter the kernel runs once, observed (:func:`~lessonlib.exercises._observe.launch_observed`): every
load and store is recorded with its program, including the lanes a missing mask sends past a tensor (recorded,
never performed, so the notebook's kernel survives them). On a GPU nothing can be recorded: the kernel runs with
grids of 1, 2, ... programs inside guarded buffers whose input holds each element's own address, so a stored value
says where it was loaded from, and the first grid that stored an element names its program.
"""

from __future__ import annotations

import torch

from lessonlib import runtime
from lessonlib.exercises._observe import findings, launch_observed
from lessonlib.exercises.triton_basics import GUARD, _launch_scale_add, _launch_transpose, _written, blocks, guarded

PAD = 3  # padding columns after each row of puzzle 2's x and out, as the checker pads them


def program_owners(kernel, puzzle: str, shape, block: dict | None = None) -> dict:
    """Run ``kernel`` (puzzle "scale_add", shape n; or "transpose", shape (M, N)) and report, for each address of
    the input's and the output's storage and a tile past it, the first program that read or wrote it (-1: none).
    Returns {"x": owners, "out": owners, "grid", "size": the valid extent, "guard": elements shown before and
    after (1-D), "pad": padding columns, "rows_past": rows shown past the end (2-D), "outside": {"x": lanes read
    outside x, "out": lanes written outside out} (-1: not known, on a GPU), "findings": what was wrong, one line
    each}; 1-D storage for scale_add, 2-D (rows, row stride) for transpose."""
    b = {**blocks(), **(block or {})}
    if any(v < 1 or v & (v - 1) for v in b.values()):
        raise ValueError(f"program_owners: block sizes must be powers of 2 (tl.arange needs them); got {block}")
    if puzzle not in ("scale_add", "transpose"):
        raise ValueError(f"program_owners: puzzle must be 'scale_add' or 'transpose', got {puzzle!r}")
    if runtime.on_gpu():
        return (_scale_add_by_grids if puzzle == "scale_add" else _transpose_by_grids)(kernel, shape, b)
    return (_scale_add_recorded if puzzle == "scale_add" else _transpose_recorded)(kernel, shape, b)


def _owners(pairs: torch.Tensor, size: int, shift: int, keep=None) -> torch.Tensor:
    """Over ``size`` cells: the first (lowest) program of (program, offset) ``pairs``, the cell offset + shift."""
    owner = torch.full((size,), -1)
    for program, offset in sorted(pairs.tolist(), reverse=True):
        cell = offset + shift if keep is None else keep(offset)
        if cell is not None and 0 <= cell < size:
            owner[cell] = program
    return owner


def _outside(record, kind: str) -> int:
    return sum(o.count for o in getattr(record, kind))


def _scale_add_recorded(kernel, n, b) -> dict:
    import triton

    n, guard, dev = int(n), 2 * b["BLOCK"], runtime.device()
    x, y = torch.arange(n, dtype=torch.float32, device=dev), torch.zeros(n, device=dev)
    out = torch.full((n,), float("nan"), device=dev)
    grid = (triton.cdiv(n, b["BLOCK"]),)
    obs = launch_observed("scale_add", kernel, grid, x, y, out, n, 1.0, BLOCK=b["BLOCK"])
    return {"x": _owners(obs.tensors["x"].reads, n + 2 * guard, guard),
            "out": _owners(obs.tensors["out"].writes, n + 2 * guard, guard), "grid": grid, "size": n,
            "guard": guard, "pad": 0, "rows_past": 0, "findings": findings(obs),
            "outside": {"x": _outside(obs.tensors["x"], "reads_outside"),
                        "out": _outside(obs.tensors["out"], "writes_outside")}}


def _transpose_recorded(kernel, shape, b) -> dict:
    import triton

    (m, n), dev = shape, runtime.device()
    x = torch.arange(m * (n + PAD), dtype=torch.float32, device=dev).view(m, n + PAD)[:, :n]
    out = torch.full((n, m + PAD), float("nan"), device=dev)[:, :m]
    grid = (triton.cdiv(m, b["BLOCK_M"]), triton.cdiv(n, b["BLOCK_N"]))
    obs = launch_observed("transpose", kernel, grid, x, out, m, n, x.stride(0), x.stride(1), out.stride(0),
                          out.stride(1), BLOCK_M=b["BLOCK_M"], BLOCK_N=b["BLOCK_N"])
    past = max(b["BLOCK_M"], b["BLOCK_N"])  # rows a tile can reach past the end
    x_rows, out_rows = m + past, n + past
    return {"x": _owners(obs.tensors["x"].reads, x_rows * (n + PAD), 0).view(x_rows, n + PAD),
            "out": _owners(obs.tensors["out"].writes, out_rows * (m + PAD), 0).view(out_rows, m + PAD),
            "grid": grid, "size": (m, n), "guard": 0, "pad": PAD, "rows_past": past, "findings": findings(obs),
            "outside": {"x": _outside(obs.tensors["x"], "reads_outside"),
                        "out": _outside(obs.tensors["out"], "writes_outside")}}


def _addresses_read(out_buffer: torch.Tensor, new: torch.Tensor, size: int) -> torch.Tensor:
    """The input addresses the new stores carry (the input held its own addresses); nonsense values dropped."""
    values = out_buffer[new]
    values = values[(values == values.round()) & (values >= 0) & (values < size)]
    return values.long()


def _scale_add_by_grids(kernel, n, b) -> dict:
    import triton

    n, guard, dev = int(n), 2 * b["BLOCK"], runtime.device()
    x_buffer = torch.arange(2 * guard + n, dtype=torch.float32, device=dev)
    x, y = x_buffer[guard:guard + n], torch.zeros(n, device=dev)
    x_owner, out_owner = torch.full((2 * guard + n,), -1), torch.full((2 * guard + n,), -1)
    grid = triton.cdiv(n, b["BLOCK"])
    for program in range(grid):
        out, out_buffer = guarded(1, n, torch.float32, guard)
        _launch_scale_add(None, kernel, x, y, out[0], 1.0, b["BLOCK"], grid=(program + 1,))
        new = _written(out[0], out_buffer) & (out_owner < 0)
        out_owner[new] = program
        x_owner[_addresses_read(out_buffer.cpu(), new, x_buffer.numel())] = program
    return {"x": x_owner, "out": out_owner, "grid": (grid,), "size": n, "guard": guard, "pad": 0, "rows_past": 0,
            "outside": {"x": -1, "out": -1}, "findings": []}


def _transpose_by_grids(kernel, shape, b) -> dict:
    import triton

    (m, n), dev = shape, runtime.device()
    past = max(b["BLOCK_M"], b["BLOCK_N"])
    x_buffer = torch.arange((m + past) * (n + PAD), dtype=torch.float32, device=dev)  # a tile's rows past the end
    x = x_buffer.view(m + past, n + PAD)[:m, :n]
    grid = (triton.cdiv(m, b["BLOCK_M"]), triton.cdiv(n, b["BLOCK_N"]))
    x_owner, out_owner = torch.full(((m + past) * (n + PAD),), -1), torch.full(((n + past) * (m + PAD),), -1)
    for i in range(grid[0]):
        for j in range(grid[1]):
            # a guard of whole rows after out: a store past the end stays inside the buffer, and shows
            out, out_buffer = guarded(n + past, m, torch.float32, guard=past * (m + PAD), pad=PAD)
            out[n:] = GUARD  # rows past the end: guard, not output
            view = out[:n]
            _launch_transpose(None, kernel, x, view, b["BLOCK_M"], b["BLOCK_N"], grid=(i + 1, j + 1))
            # grid (i + 1, j + 1) runs every program (i', j') with i' <= i, j' <= j; all but (i, j) ran before
            start = past * (m + PAD)
            new = _written(view, out_buffer)[start:start + out_owner.numel()] & (out_owner < 0)
            out_owner[new] = i * grid[1] + j
            x_owner[_addresses_read(out_buffer[start:start + out_owner.numel()].cpu(), new, x_buffer.numel())] = \
                i * grid[1] + j
    return {"x": x_owner.view(m + past, n + PAD), "out": out_owner.view(n + past, m + PAD), "grid": grid,
            "size": (m, n), "guard": 0, "pad": PAD, "rows_past": past, "outside": {"x": -1, "out": -1},
            "findings": []}
