"""Run the course notebooks top to bottom in a fresh kernel and store their outputs (what readers see on GitHub,
and what nbval compares in cells marked NBVAL_CHECK_OUTPUT).

    python tools/execute_notebooks.py [notebooks/01_operator_fusion.ipynb ...]
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def main(paths):
    for path in paths or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        path = Path(path)
        start = time.time()
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(notebook, path)
        print(f"executed {path.name} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
