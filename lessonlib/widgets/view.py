"""The view every lesson's explorer is: controls above the text and the figure that a plain function prints and draws.

Why not ``ipywidgets.interactive``: it shows the function's output through an ``Output`` widget, which the front
end fills with the kernel's display messages, matched by their parent message. In JupyterLab 4.6 with ipykernel 7,
widget messages run in a kernel subshell, and the figure of one redraw was sometimes published under the previous
redraw's parent: the printed numbers changed and the figure vanished (about one run in five of
tests/browser/test_recorded_views.py). Here the printed text and the PNG of the figure are widget state (an ``HTML``
and an ``Image``), which the front end matches by widget, so a redraw cannot be lost or land in another view.
"""

from __future__ import annotations

import contextlib
import html
import io
import traceback
from typing import Callable
from unittest import mock

import ipywidgets as w
import matplotlib.pyplot as plt

VIEW_CLASS = "lessonlib-view"  # the CSS class browser tests find a view by


class FigureView(w.VBox):
    """``fn(**fixed, **{name: control.value})`` prints its numbers, draws one matplotlib figure and returns what it
    showed (``result``, which tests and nbval check); the view runs it now and again whenever a control moves.
    A ``plt.show()`` inside ``fn`` does nothing: the figure is drawn into the view, not into the cell's output."""

    def __init__(self, fn: Callable[..., dict], controls: dict[str, w.ValueWidget], fixed: dict | None = None):
        self.fn, self.controls, self.fixed = fn, controls, fixed or {}
        self.text = w.HTML()
        self.figure = w.Image(format="png", layout=w.Layout(max_width="100%", height="auto"))
        super().__init__([*controls.values(), self.text, self.figure])
        self.add_class(VIEW_CLASS)
        self.result: dict | None = None
        self._drawing = True
        self._run(raise_errors=True)  # a cell that builds a broken view fails, rather than showing a traceback
        for control in controls.values():
            control.observe(self._moved, names="value")

    def update(self) -> None:
        """Run the function at the controls' values and redraw."""
        self._run(raise_errors=False)

    @contextlib.contextmanager
    def quietly(self):
        """Inside, moving a control recomputes ``result`` without drawing (``drive`` moves controls there and back);
        on the way out the view redraws once, at whatever its controls then show."""
        self._drawing = False
        try:
            yield self
        finally:
            self._drawing = True
            self.update()

    def _moved(self, change) -> None:
        self.update()

    def _run(self, raise_errors: bool) -> None:
        before = set(plt.get_fignums())
        plt.figure()  # fn's plt.plot() draws here, not into a figure some other cell left current
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), mock.patch.object(plt, "show", lambda *args, **kwargs: None):
                self.result = self.fn(**self.fixed, **{name: c.value for name, c in self.controls.items()})
        except Exception:
            if raise_errors:
                raise
            self.result = None
            self._show(printed.getvalue() + traceback.format_exc(), None)
            return
        finally:
            drawn = [plt.figure(n) for n in plt.get_fignums() if n not in before]
            for fig in drawn:
                plt.close(fig)
        drawn = [fig for fig in drawn if fig.axes]  # the empty figure above, when fn made its own
        self._show(printed.getvalue(), drawn[-1] if drawn and self._drawing else None)

    def _show(self, text: str, fig) -> None:
        if not self._drawing:
            return
        self.text.value = f"<pre style='margin: 4px 0; line-height: 1.35'>{html.escape(text.rstrip())}</pre>"
        if fig is not None:
            png = io.BytesIO()
            fig.savefig(png, format="png", bbox_inches="tight")
            self.figure.value = png.getvalue()
        self.figure.layout.display = None if fig is not None else "none"
