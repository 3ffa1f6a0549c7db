"""Printed lines fit the output they are read in. JupyterLab at 1280x800, its file browser open, gives a cell's
output 107 characters of its monospace font (measured in Chromium, JupyterLab 4.6; tests/browser checks the page
itself) and breaks a longer line at the edge, wherever that falls: inside a number ("4|50 us"). So every line a
lesson prints, in the stored outputs of the instructor notebooks and the appendix, is at most
lessonlib.runtime.PRINT_WIDTH (100) characters. Not counted: a widget's text/plain (the browser shows the widget),
and a figure's text/plain. Reads JSON only: well under a second."""

from pathlib import Path

import nbformat
import pytest

from lessonlib.runtime import PRINT_WIDTH

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SHOWN_INSTEAD = ("application/vnd.jupyter.widget-view+json", "image/png", "image/svg+xml", "text/html")


def printed_lines(output) -> list[str]:
    if output.output_type == "stream":
        return output.text.split("\n")
    data = output.get("data", {})
    if "text/plain" in data and not any(kind in data for kind in SHOWN_INSTEAD):
        return data["text/plain"].split("\n")
    return []


def too_long(path: Path) -> list[str]:
    found = []
    for number, cell in enumerate(nbformat.read(path, as_version=4).cells):
        for output in cell.get("outputs", []):
            found += [f"cell {number} ({cell.get('id', '?')}), {len(line)} characters: {line[:90]}..."
                      for line in printed_lines(output) if len(line) > PRINT_WIDTH]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_printed_lines_fit_the_output(path):
    found = too_long(path)
    assert not found, f"{path.name}: {len(found)} lines over {PRINT_WIDTH} characters:\n" + "\n".join(found)


def test_the_count_sees_a_long_line_and_not_a_widget(tmp_path):
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(x)")
    cell.outputs = [nbformat.v4.new_output("stream", text="short\n" + "4" * (PRINT_WIDTH + 1) + " us\n"),
                    nbformat.v4.new_output("display_data", data={
                        "text/plain": "FigureView(" + "x" * 200, "application/vnd.jupyter.widget-view+json": {}})]
    notebook.cells = [cell]
    nbformat.write(notebook, tmp_path / "made_up.ipynb")
    assert len(too_long(tmp_path / "made_up.ipynb")) == 1


def test_vllm_numa_notice_is_left_out_and_the_rest_of_stderr_kept(capfd):
    """vLLM's CPU worker writes a 220-character NUMA notice to file descriptor 2 from C++ at each engine start;
    lessonlib.serving starts engines with it left out, and passes every other line on."""
    import os

    from lessonlib.serving.in_process import NUMA_NOTICE, _without_numa_notice

    notice = f"[W1205 01:02:25 utils.cpp:68] Warning: {NUMA_NOTICE} MEMBIND policy for memory allocation " + "x" * 120
    with _without_numa_notice():
        os.write(2, f"before\n{notice}\nafter: a warning a student needs\n".encode())
    err = capfd.readouterr().err
    assert NUMA_NOTICE not in err and "before\n" in err and "after: a warning a student needs" in err, err
