"""What the grading tests share: the sandbox they grade in."""

import shutil

import pytest

from lessonlib.grading import sandbox


def sandbox_or_skip() -> str:
    """The sandbox the grader chooses here: bwrap wherever bubblewrap is installed (a sandbox that cannot start there
    fails the test, not skips it), else unshare; the test is skipped, with the reason, where neither can start."""
    if shutil.which("bwrap"):
        mode, why = sandbox.choose("auto")
        assert mode == "bwrap", f"bubblewrap is installed but the grader's sandbox cannot start: {why}"
        return "bwrap"
    try:
        return sandbox.choose("unshare")[0]
    except sandbox.SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine (install bubblewrap: make setup): {e}")
