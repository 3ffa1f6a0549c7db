"""A real-browser harness for the course notebooks: JupyterLab served on localhost, driven by headless Chromium
through Playwright. Reusable by every lesson's browser test:

    with JupyterLab(notebook_paths) as lab, lab.browser() as page:
        lab.open(page, "00_setup_and_roofline.ipynb")
        lab.run_all(page)
        lab.slider(page, "tokens T").press("ArrowRight")

The notebooks are copied into a temporary folder first, outputs cleared, so that everything the browser shows
came from this run and neither the run nor JupyterLab's autosave edits the repository's files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def why_not_here() -> str | None:
    """Why the browser tests cannot run on this machine (each test module skips with it), or None. They need
    Playwright, JupyterLab and ipywidgets in this environment and Debian's Chromium; the lab's GPU machine has none
    of them (`make setup` installs all four)."""
    import importlib.util

    missing = [name for name in ("playwright", "jupyterlab", "ipywidgets") if importlib.util.find_spec(name) is None]
    if not shutil.which(CHROMIUM):
        missing.append("Chromium (Debian package 'chromium')")
    if missing:
        return f"needs a browser and JupyterLab; missing here: {', '.join(missing)} (`make setup` installs them)"
    return None


def excerpt(cells: list[tuple[Path, str]], out: Path) -> Path:
    """A notebook made of the lesson notebooks' own cells, ``(notebook, cell id)`` in that order, written to
    ``out``: a browser test runs the lessons' real widget cells after a set-up cell, without the whole lessons."""
    found = []
    for path, cell_id in cells:
        by_id = {cell.get("id"): cell for cell in nbformat.read(path, as_version=4).cells}
        if cell_id not in by_id:
            raise KeyError(f"{path.name} has no cell {cell_id!r}")
        found.append(by_id[cell_id])
    notebook = nbformat.read(cells[0][0], as_version=4)
    for number, cell in enumerate(found):  # two lessons' cells may share an id
        cell.id = f"{number}-{cell.id}"[:64]
    notebook.cells = found
    nbformat.write(notebook, out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The student lab's configuration (`make lab` puts it first on JUPYTER_CONFIG_PATH): the tests see what students see.
LAB_CONFIG = Path(__file__).resolve().parents[2] / "tools" / "lab"


class JupyterLab:
    def __init__(self, notebooks: list[Path], startup_timeout: float = 120):
        self.notebooks = notebooks
        self.startup_timeout = startup_timeout
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="lessonlib-lab-")
        base = Path(self._tmp.name)
        root = base / "lab"  # what the file browser shows: the notebooks alone (the log and settings beside it)
        root.mkdir()
        for path in self.notebooks:
            notebook = nbformat.read(path, as_version=4)
            for cell in notebook.cells:
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            nbformat.write(notebook, root / path.name)
        # Every cell stays in the page (no windowing), so tests see all prompts and outputs wherever they scroll.
        settings = base / ".settings" / "@jupyterlab" / "notebook-extension"
        settings.mkdir(parents=True)
        (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
        config_path = os.pathsep.join(p for p in (str(LAB_CONFIG), os.environ.get("JUPYTER_CONFIG_PATH")) if p)
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(base / ".runtime"), "JUPYTERLAB_SETTINGS_DIR": str(base / ".settings"),
               "MPLBACKEND": "module://matplotlib_inline.backend_inline", "JUPYTER_CONFIG_PATH": config_path}
        self.log = open(base / "lab.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={self.port}",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={root}",
             f"--LabApp.workspaces_dir={base / '.workspaces'}", "--ServerApp.disable_check_xsrf=False"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited: {self.logs()}")
            try:
                urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"JupyterLab did not answer in {self.startup_timeout} s: {self.logs()}")

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
        self._tmp.cleanup()

    def logs(self) -> str:
        self.log.flush()
        return (Path(self._tmp.name) / "lab.log").read_text()[-4000:]

    @contextlib.contextmanager
    def browser(self, width: int = 1400, height: int = 1000):
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width, "height": height})
            try:
                yield page
            finally:
                browser.close()

    def open(self, page, name: str, timeout_ms: int = 90_000, workspace: str | None = None) -> None:
        """Open notebook ``name``; with ``workspace``, in a workspace of that name, so that a test opening several
        notebooks on one server does not get the previous one restored beside it."""
        where = f"workspaces/{workspace}/tree" if workspace else "tree"
        page.goto(f"{self.url}/lab/{where}/{name}?token={self.token}")
        page.wait_for_selector(".jp-Notebook", timeout=timeout_ms)
        # A fresh JupyterLab may ask which kernel to start; the notebook's own (python3) is preselected.
        dialog = page.locator(".jp-Dialog:has-text('Select Kernel') button:has-text('Select')")
        try:
            dialog.click(timeout=10_000)
        except Exception:  # no dialog: the kernel started by itself
            pass
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout_ms)

    def run_all(self, page, timeout_ms: int = 300_000) -> None:
        """Run → Run All Cells, then wait until every code cell has an execution number and the kernel is idle.
        (Waiting only for "no [*]" races the click: just after it, no cell is queued yet.)"""
        page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
        page.wait_for_function(
            "() => { const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];"
            " return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent)); }",
            timeout=timeout_ms,
        )
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout_ms)

    def shut_down_kernels(self) -> None:
        """Stop every kernel this server runs (a test that opened several notebooks leaves none behind)."""
        import json

        url = f"{self.url}/api/kernels?token={self.token}"
        for kernel in json.load(urllib.request.urlopen(url, timeout=10)):
            request = urllib.request.Request(f"{self.url}/api/kernels/{kernel['id']}?token={self.token}",
                                             method="DELETE")
            urllib.request.urlopen(request, timeout=30)

    def slider(self, page, label: str):
        """The handle of the ipywidgets slider whose description is ``label``."""
        return page.locator(".widget-slider", has=page.locator(".widget-label", has_text=label)).locator(".noUi-handle").first
