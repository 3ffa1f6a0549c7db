"""What the grading tests share: the sandbox they grade in."""

import shutil

import pytest

from lessonlib.grading import sandbox


def sandbox_or_skip() -> str:
    """bwrap wherever it is installed (a sandbox that cannot start there fails the test); else unshare; else skip:
    without a sandbox the grader refuses to grade (tests/test_grading_sandbox.py checks that refusal), as on the GPU
    lab's machine, which has neither bubblewrap nor the namespaces unshare needs."""
    if shutil.which("bwrap"):
        mode, why = sandbox.choose("auto")
        assert mode == "bwrap", f"bubblewrap is installed but the grader's sandbox cannot start: {why}"
        return "bwrap"
    try:
        return sandbox.choose("unshare")[0]
    except sandbox.SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine (install bubblewrap: make setup): {e}")
