"""Notebook 00 in a real browser: it runs, its roofline explorer renders, and moving a slider changes the view."""

import re
from pathlib import Path

import pytest

from tests.browser.harness import why_not_here

if why_not_here():
    pytest.skip(why_not_here(), allow_module_level=True)

from lessonlib.widgets.view import VIEW_CLASS  # noqa: E402  (ipywidgets: after the skip)
from tests.browser.harness import JupyterLab  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "00_setup_and_roofline.ipynb"


def test_roofline_explorer_follows_its_slider():
    with JupyterLab([NOTEBOOK]) as lab, lab.browser() as page:
        lab.open(page, NOTEBOOK.name)
        lab.run_all(page)
        outputs = page.locator(".jp-Notebook").inner_text()
        assert "Traceback" not in outputs, outputs[-3000:]

        view = page.locator(f".{VIEW_CLASS}").first
        summary = view.locator("pre").first
        summary.wait_for(timeout=60_000)
        before_text = summary.inner_text()
        before_plot = view.locator("img").first.get_attribute("src")
        assert re.search(r"gated_mlp at T=8192: .* compute-bound", before_text), before_text

        handle = lab.slider(page, "tokens T")
        handle.scroll_into_view_if_needed()
        handle.focus()
        handle.press("ArrowRight")
        # The kernel redraws text and figure in turn; wait for both, read from the page (not from visibility).
        page.wait_for_function(
            "([view, oldText, oldPlot]) => { const root = document.querySelector(view);"
            " const pre = root.querySelector('pre'); const img = root.querySelector('img');"
            " return pre && img && pre.innerText !== oldText && img.getAttribute('src') !== oldPlot; }",
            arg=[f".{VIEW_CLASS}", before_text, before_plot], timeout=60_000)
        after_text = summary.inner_text()
        assert "gated_mlp at T=8193" in after_text, after_text
