"""Lesson 00's figure: which addresses each Triton program touched, from an instrumented launch of a kernel
(:func:`lessonlib.exercises.addresses.program_owners`), not drawn by hand."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.ticker import MaxNLocator

from lessonlib.plots._figure import finish


def _owner_image(ax, owners: np.ndarray, programs: int, title: str, labels) -> None:
    colors = plt.get_cmap("tab10" if programs <= 10 else "tab20")(np.arange(programs) % 20)
    cmap = ListedColormap(np.vstack([[0.93, 0.93, 0.93, 1.0], colors]))  # light grey: no program
    ax.imshow(owners + 1, cmap=cmap, vmin=0, vmax=programs, aspect="equal", interpolation="nearest")
    for (r, c), owner in np.ndenumerate(owners):
        if owner >= 0 and owners.size <= 400:
            ax.text(c, r, labels(owner), ha="center", va="center", fontsize=6, color="white")
    ax.set_title(title, fontsize=10)
    ax.set_yticks([])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # element indices: whole numbers


def _outside_note(owners: dict, what: str, verb: str) -> str:
    count = owners.get("outside", {}).get(what, -1)
    return f"\n{count} lanes {verb} outside {what}: a missing mask" if count > 0 else ""


def program_map(vector: dict, tile: dict):
    """Three panels from two :func:`program_owners` results: the 1-D puzzle's x and out (each cell one element,
    coloured by the program that read or wrote it, the guard past the end in grey) and the 2-D puzzle's x storage
    (its padding columns after the dashed line) and out."""
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), gridspec_kw={"height_ratios": [1, 2.2, 2.6]})
    n, guard = vector["size"], vector["guard"]
    shown = slice(guard, guard + n + min(guard, 8))  # the elements, and a few guard cells past the end
    strip = np.vstack([vector["x"][shown].numpy(), vector["out"][shown].numpy()])
    _owner_image(axes[0], strip, vector["grid"][0], f"scale_add: n = {n}, {vector['grid'][0]} programs; "
                 "top row x read, bottom row out written" + _outside_note(vector, "out", "written"), str)
    axes[0].axvline(n - 0.5, color="black", linestyle="--", linewidth=1)
    axes[0].set_yticks([0, 1], ["x", "out"])
    axes[0].set_xlabel("element index (past the dashed line: the guard after the end)")
    (m, cols), grid = tile["size"], tile["grid"]
    label = lambda owner: f"{owner // grid[1]},{owner % grid[1]}"  # noqa: E731 (program (pid 0, pid 1))
    _owner_image(axes[1], tile["x"].numpy(), grid[0] * grid[1], f"transpose: x is ({m}, {cols}) with row stride "
                 f"{cols + tile['pad']}: the storage each program (pid 0, pid 1) read"
                 + _outside_note(tile, "x", "read"), label)
    axes[1].axvline(cols - 0.5, color="black", linestyle="--", linewidth=1)
    if tile.get("rows_past"):  # the rows below the line are past x's end
        axes[1].axhline(m - 0.5, color="black", linestyle="--", linewidth=1)
    axes[1].set_xlabel("column of x's storage (past the dashed lines: padding, and rows past the end)")
    axes[1].set_ylabel("row of x")
    _owner_image(axes[2], tile["out"].numpy(), grid[0] * grid[1], f"out = x.T, ({cols}, {m}): what each program "
                 "wrote" + _outside_note(tile, "out", "written"), label)
    axes[2].axvline(m - 0.5, color="black", linestyle="--", linewidth=1)
    if tile.get("rows_past"):
        axes[2].axhline(cols - 0.5, color="black", linestyle="--", linewidth=1)
    axes[2].set_xlabel("column of out's storage (past the dashed lines: padding, and rows past the end)")
    axes[2].set_ylabel("row of out")
    recorded = vector.get("outside", {}).get("out", -1) >= 0
    return finish(fig, "measured: every load and store of the kernel recorded in Triton's interpreter (accesses "
                       "outside a tensor recorded, not performed)" if recorded else
                       "measured: the kernel run with grids of 1, 2, ... programs; each input element holds its "
                       "own address, so every stored value says where it was loaded from")
