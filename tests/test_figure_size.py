"""A figure is drawn at the size JupyterLab shows it at 1280x800 (lessonlib/plots/_figure.py): the PNG a notebook
saves for it (bbox_inches="tight", as the inline backend and FigureView save) is at most OUTPUT_PX wide, so it is
shown at its natural size, and no text is under MIN_FONT points. Integer axes are ticked at integers."""

import io
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from PIL import Image  # noqa: E402

from lessonlib.plots._figure import MIN_FONT, OUTPUT_PX, WIDTH, finish, integer_ticks  # noqa: E402


def _png_width(fig) -> int:
    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight")
    return Image.open(io.BytesIO(png.getvalue())).size[0]


@pytest.mark.parametrize("width, legend_outside", [(13, False), (14, True), (WIDTH, True), (5, False)])
def test_finish_fits_a_figure_to_the_output_area(width, legend_outside):
    fig, (left, right) = plt.subplots(1, 2, figsize=(width, 4))
    left.plot([1, 2, 3], label="a long legend entry, outside the axes")
    right.plot([3, 2, 1])
    right.text(1, 2, "small", fontsize=5)
    if legend_outside:
        left.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    finish(fig, "recorded on a made-up GPU, a footnote long enough to wrap at a narrower width " * 2)
    shown = _png_width(fig)
    assert shown <= OUTPUT_PX, shown
    if width <= 5:  # a narrow figure is left as it is
        assert fig.get_size_inches()[0] == pytest.approx(width)
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text()]
    assert min(sizes) >= MIN_FONT, sizes
    plt.close(fig)


def test_integer_ticks_label_whole_numbers_only():
    fig, ax = plt.subplots()
    ax.imshow([[0, 1, 2, 3, 4, 5]] * 3)
    integer_ticks(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
    assert labels and all(label.lstrip("−-").isdigit() for label in labels), labels
    plt.close(fig)


NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_stored_figure_fits_the_output(path):
    """The figures a lesson's stored outputs hold (the instructor copies, the appendix): each PNG at most OUTPUT_PX
    wide (or the width its metadata asks for, for a hi-dpi one), so JupyterLab shows it whole. Reads JSON only."""
    import base64

    import nbformat

    wide = []
    for number, cell in enumerate(nbformat.read(path, as_version=4).cells):
        for output in cell.get("outputs", []):
            if "image/png" not in output.get("data", {}):
                continue
            width = Image.open(io.BytesIO(base64.b64decode(output["data"]["image/png"]))).size[0]
            width = output.get("metadata", {}).get("image/png", {}).get("width", width)
            if width > OUTPUT_PX:
                wide.append(f"cell {number} ({cell.get('id', '?')}): {width} px")
    assert not wide, f"{path.name}: figures wider than {OUTPUT_PX} px, shown scaled down:\n" + "\n".join(wide)
