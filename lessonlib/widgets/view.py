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
import threading
import traceback
from typing import Callable
from unittest import mock

import ipywidgets as w
import matplotlib.pyplot as plt

VIEW_CLASS = "lessonlib-view"  # the CSS class browser tests find a view by


# pyplot's figures, sys.stdout and plt.show are the whole process's: one run at a time, whichever thread a widget
# callback comes on (JupyterLab's kernel subshells run them on their own thread).
_RUNNING = threading.RLock()


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
        self._quiet = False
        self._run(draw=True, raise_errors=True)  # a cell that builds a broken view fails, rather than showing a traceback
        for control in controls.values():
            control.observe(self._moved, names="value")

    def update(self) -> None:
        """Run the function at the controls' values and redraw (a failure: its traceback shown in the view)."""
        self._run(draw=True, raise_errors=False)

    def compute(self) -> dict:
        """Run the function at the controls' values without drawing; return its result, raise what it raises."""
        self._run(draw=False, raise_errors=True)
        return self.result

    @contextlib.contextmanager
    def quietly(self):
        """Inside, moving a control runs nothing (``drive`` moves controls there and back, and calls ``compute``
        once); on the way out the view redraws once, at whatever its controls then show."""
        self._quiet = True
        try:
            yield self
        finally:
            self._quiet = False
            self.update()

    def _moved(self, change) -> None:
        if not self._quiet:
            self.update()

    def _run(self, draw: bool, raise_errors: bool) -> None:
        with _RUNNING:
            before = set(plt.get_fignums())
            plt.figure()  # fn's plt.plot() draws here, not into a figure some other cell left current
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed), mock.patch.object(plt, "show", lambda *args, **kwargs: None):
                    self.result = self.fn(**self.fixed, **{name: c.value for name, c in self.controls.items()})
            except Exception:
                self.result = None
                if raise_errors:
                    raise
                if draw:
                    self._show(printed.getvalue() + traceback.format_exc(), None)
                return
            finally:
                drawn = [plt.figure(n) for n in plt.get_fignums() if n not in before]
                for fig in drawn:
                    plt.close(fig)
            if draw:
                drawn = [fig for fig in drawn if fig.axes]  # the empty figure above, when fn made its own
                self._show(printed.getvalue(), drawn[-1] if drawn else None)

    def _show(self, text: str, fig) -> None:
        # A line too long for the output wraps between words, never inside a number (JupyterLab breaks a printed
        # line anywhere: "4|50 us").
        self.text.value = (f"<pre style='margin: 4px 0; line-height: 1.35; white-space: pre-wrap; word-break: normal; "
                           f"overflow-wrap: normal'>{html.escape(text.rstrip())}</pre>")
        if fig is not None:
            png = io.BytesIO()
            fig.savefig(png, format="png", bbox_inches="tight")
            self.figure.value = png.getvalue()
        self.figure.layout.display = None if fig is not None else "none"
