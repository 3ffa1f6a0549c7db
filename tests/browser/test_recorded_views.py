"""Lessons 01-05's "recorded run beside your GPU" views in a real browser: each lesson's own set-up cell and view
cell (taken from the lesson notebook by cell id, so the test runs the real cells, not a copy) run in JupyterLab;
choosing another case in the view's dropdown redraws its figure, and the page shows no Traceback.

One JupyterLab serves the five excerpts (its start-up is paid once); each test opens its own notebook and kernel."""

import shutil
from pathlib import Path

import pytest

from tests.browser.harness import CHROMIUM, JupyterLab, excerpt

pytest.importorskip("playwright")
if not shutil.which(CHROMIUM):
    pytest.skip("Chromium is not installed (Debian package 'chromium'; `make setup` installs it)", allow_module_level=True)

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
VIEWS = {  # notebook: its set-up cell, what the view cell needs defined, the view cell
    "01_operator_fusion.ipynb": ["af0aed51", "e4bfb921", "0fd7cd39"],
    "02_flash_attention.ipynb": ["d02e44cb", "recorded-run-view"],
    "03_paged_attention.ipynb": ["42a16408", "recorded-run-view"],
    "04_torch_compile.ipynb": ["8fceb4a5", "recorded-run-view"],
    "05_cuda_graphs.ipynb": ["a0c99c59", "recorded-run-view"],
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("views")
    paths = [excerpt(NOTEBOOKS / name, ids, folder) for name, ids in VIEWS.items()]
    with JupyterLab(paths) as lab:
        yield lab


@pytest.mark.parametrize("notebook", sorted(VIEWS))
def test_choosing_another_case_redraws_the_view(lab, notebook):
    with lab.browser() as page:
        lab.open(page, notebook)
        lab.run_all(page)
        view = page.locator(".widget-interact").first
        view.locator("img").first.wait_for(timeout=60_000)
        before = view.locator("img").first.get_attribute("src")
        case = view.locator(".widget-dropdown select").first
        options = case.locator("option").all_inner_texts()
        chosen = case.input_value()
        other = next(o for o in options if o != chosen)
        case.select_option(label=other)
        page.wait_for_function(
            "(old) => { const img = document.querySelector('.widget-interact img');"
            " return img && img.getAttribute('src') !== old; }", arg=before, timeout=60_000)
        text = page.locator(".jp-Notebook").inner_text()
        assert "Traceback" not in text, text[-3000:]
        assert case.input_value() == other  # the control shows the case the figure was redrawn for
    lab.shut_down_kernels()
