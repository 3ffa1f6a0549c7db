"""Lessons 01-05's "recorded run beside your GPU" views, and lesson 07's KV-blocks view (a FigureView written in the
notebook itself), in a real browser. One small notebook is made of the lessons' own cells (taken by cell id, so the
test runs the real cells, not copies): the set-up cell (the same in every lesson), lessons 01's and 07's imports,
then each lesson's view cell. It runs once in JupyterLab (one start-up, one
kernel: a whole lesson costs 20-60 s under the interpreter); each lesson's test then chooses another case in its
view's dropdown and waits for the figure to be redrawn, with no Traceback in the page. Every view's sliders,
dropdowns and lists show their labels and options whole, and lesson 07's KV-blocks view names both its controls and
redraws when its slider moves."""

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


def _index(notebook) -> int:
    return len(SET_UP) + sorted(VIEWS).index(notebook)


def _view(page, notebook):
    view = page.locator(".jp-CodeCell").nth(_index(notebook)).locator(f".{VIEW_CLASS}")
    view.locator("img").first.wait_for(timeout=60_000)
    return view


def _wait_for_redraw(page, notebook, before: str, what: str) -> None:
    """The kernel sends the new figure as the view's image: wait for an image whose src differs from ``before``."""
    try:
        page.wait_for_function(
            "([index, view, old]) => { const img = document.querySelectorAll('.jp-CodeCell')[index]"
            ".querySelector(view + ' img'); return img && img.getAttribute('src') !== old; }",
            arg=[_index(notebook), f".{VIEW_CLASS}", before], timeout=60_000)
    except Exception:
        view = _view(page, notebook)
        shows = view.inner_text()[-2000:]
        pytest.fail(f"{notebook}: the figure was not redrawn after {what}; the view shows:\n{shows}")


@pytest.mark.parametrize("notebook", sorted(VIEWS))
def test_choosing_another_case_redraws_the_view(page, notebook):
    view = _view(page, notebook)
    before = view.locator("img").first.get_attribute("src")
    case = view.locator(".widget-dropdown select").first
    other = (case.evaluate("select => select.selectedIndex") + 1) % case.locator("option").count()
    case.select_option(index=other)
    _wait_for_redraw(page, notebook, before, "another case was chosen")
    assert case.evaluate("select => select.selectedIndex") == other  # the control shows the case redrawn
    text = page.locator(".jp-Notebook").inner_text()
    assert "Traceback" not in text, text[-3000:]


# Each slider's, dropdown's and list's label as the page shows it, and whether the page cut it short: a label whose
# text is wider than its box shows "implemen...", a list narrower than its options clips their names.
CONTROLS_JS = """root => [...root.querySelectorAll('.widget-hslider, .widget-dropdown, .widget-select-multiple')]
  .map(control => { const label = control.querySelector('.widget-label');
                    const list = control.querySelector('select[multiple]');
                    const kinds = ['widget-hslider', 'widget-dropdown', 'widget-select-multiple'];
                    return {kind: kinds.find(kind => control.classList.contains(kind)),
                            label: label ? label.innerText.trim() : '',
                            label_cut: label ? label.scrollWidth > label.clientWidth : false,
                            options_cut: list ? list.scrollWidth > list.clientWidth : false}; })"""


@pytest.mark.parametrize("notebook", sorted(VIEWS))
def test_every_control_shows_its_whole_label_and_options(page, notebook):
    controls = _view(page, notebook).evaluate(CONTROLS_JS)
    assert controls, f"{notebook}: no control found in its view"
    for control in controls:
        assert control["label"] and not control["label_cut"], f"{notebook}: a label missing or cut short: {control}"
        assert not control["options_cut"], f"{notebook}: a list cuts its options' names short: {control}"


def test_the_kv_blocks_view_names_both_controls_and_follows_its_slider(page):
    """Lesson 07's KV-blocks view: the slider and the dropdown say what they set, and moving the slider redraws."""
    notebook = "07_serving_engine.ipynb"
    view = _view(page, notebook)
    labels = {c["kind"]: c["label"] for c in view.evaluate(CONTROLS_JS)}
    assert labels == {"widget-hslider": "arrival rate (requests per step)", "widget-dropdown": "block size (tokens)"}
    before = view.locator("img").first.get_attribute("src")
    handle = view.locator(".widget-slider .noUi-handle").first
    handle.scroll_into_view_if_needed()
    handle.focus()
    handle.press("ArrowRight")
    _wait_for_redraw(page, notebook, before, "the slider moved")
    assert "0.12" in view.locator(".widget-slider").first.inner_text()  # one step of 0.02 from 0.10
