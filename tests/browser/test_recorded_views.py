"""Lessons 01-05's "recorded run beside your GPU" views, and lesson 07's KV-blocks view (a FigureView written in the
notebook itself), in a real browser. One small notebook is made of the lessons' own cells (taken by cell id, so the
test runs the real cells, not copies): the set-up cell (the same in every lesson), lessons 01's and 07's imports,
then each lesson's view cell. It runs once in JupyterLab (one start-up, one
kernel: a whole lesson costs 20-60 s under the interpreter); each lesson's test then chooses another case in its
view's dropdown and waits for the figure to be redrawn, with no Traceback in the page."""

from pathlib import Path

import pytest

from tests.browser.harness import why_not_here

if why_not_here():
    pytest.skip(why_not_here(), allow_module_level=True)

from lessonlib.widgets.view import VIEW_CLASS  # noqa: E402  (ipywidgets: after the skip)
from tests.browser.harness import JupyterLab, excerpt  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
VIEWS = {  # lesson notebook: its view cell's id
    "01_operator_fusion.ipynb": "0fd7cd39",
    "02_flash_attention.ipynb": "recorded-run-view",
    "03_paged_attention.ipynb": "recorded-run-view",
    "04_torch_compile.ipynb": "recorded-run-view",
    "05_cuda_graphs.ipynb": "recorded-run-view",
    "07_serving_engine.ipynb": "ba883e3d",  # requests arriving: KV blocks used vs reserved
}
SET_UP = [(NOTEBOOKS / "01_operator_fusion.ipynb", "af0aed51"),  # the set-up cell
          (NOTEBOOKS / "01_operator_fusion.ipynb", "e4bfb921"),  # lesson 01's imports, which its view cell uses
          (NOTEBOOKS / "07_serving_engine.ipynb", "749b9ffb")]  # lesson 07's (simulate, plot_simulation)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = excerpt(SET_UP + [(NOTEBOOKS / name, cell) for name, cell in VIEWS.items()],
                   tmp_path_factory.mktemp("views") / "recorded_views.ipynb")
    with JupyterLab([path]) as lab, lab.browser() as page:
        lab.open(page, path.name)
        lab.run_all(page)
        text = page.locator(".jp-Notebook").inner_text()
        assert "Traceback" not in text, text[-3000:]
        yield page


@pytest.mark.parametrize("notebook", sorted(VIEWS))
def test_choosing_another_case_redraws_the_view(page, notebook):
    index = len(SET_UP) + sorted(VIEWS).index(notebook)
    view = page.locator(".jp-CodeCell").nth(index).locator(f".{VIEW_CLASS}")
    view.locator("img").first.wait_for(timeout=60_000)
    before = view.locator("img").first.get_attribute("src")
    case = view.locator(".widget-dropdown select").first
    other = (case.evaluate("select => select.selectedIndex") + 1) % case.locator("option").count()
    case.select_option(index=other)
    # The kernel sends the new figure as the view's image: wait for an image whose src differs.
    try:
        page.wait_for_function(
            "([index, view, old]) => { const img = document.querySelectorAll('.jp-CodeCell')[index]"
            ".querySelector(view + ' img'); return img && img.getAttribute('src') !== old; }",
            arg=[index, f".{VIEW_CLASS}", before], timeout=60_000)
    except Exception:
        pytest.fail(f"{notebook}: the figure was not redrawn; the view shows:\n{view.inner_text()[-2000:]}")
    assert case.evaluate("select => select.selectedIndex") == other  # the control shows the case redrawn
    text = page.locator(".jp-Notebook").inner_text()
    assert "Traceback" not in text, text[-3000:]
