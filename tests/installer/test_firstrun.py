"""app/firstrun.py: GPU detection, the plan, the setup steps and the progress window, without network or GPU
(nvidia-smi is a fake script, pip a fake runner)."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from app import firstrun as fr

SMI_QUERY = "NVIDIA GeForce RTX 4090, 565.57.01, 24564, 8.9\n"
SMI_BANNER = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 565.57.01              Driver Version: 565.57.01      CUDA Version: 12.7     |
+-----------------------------------------------------------------------------------------+
"""


def gpu(cuda=(12, 8), compute=(8, 9), name="RTX 4090", mem=24564, driver="570.1"):
    return fr.GpuProbe(name, driver, cuda, compute, mem)


def test_parse_smi():
    g, = fr.parse_smi(SMI_QUERY, SMI_BANNER)
    assert (g.name, g.driver, g.cuda, g.compute, g.memory_mib) == ("NVIDIA GeForce RTX 4090", "565.57.01", (12, 7),
                                                                    (8, 9), 24564)
    # old drivers: no compute_cap column, no CUDA line
    g, = fr.parse_smi("Tesla K80, 470.1, 11441\n", "")
    assert g.compute is None and g.cuda is None


def fake_smi(tmp_path: Path, query: str, banner: str, rc: int = 0) -> str:
    p = tmp_path / "nvidia-smi"
    p.write_text(f"#!{sys.executable}\nimport sys\n"
                 f"if any(a.startswith('--query') for a in sys.argv[1:]):\n"
                 f"    sys.stdout.write({query!r}); sys.exit({rc})\n"
                 f"sys.stdout.write({banner!r})\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


@pytest.mark.skipif(sys.platform == "win32", reason="shebang script")
def test_probe_gpus_runs_nvidia_smi(tmp_path):
    gpus, reason = fr.probe_gpus(fake_smi(tmp_path, SMI_QUERY, SMI_BANNER))
    assert reason == "" and gpus[0].cuda == (12, 7) and gpus[0].compute == (8, 9)
    gpus, reason = fr.probe_gpus(fake_smi(tmp_path, "NVIDIA-SMI has failed because it couldn't communicate with "
                                                    "the NVIDIA driver.\n", "", rc=9))
    assert gpus == [] and "not working" in reason and "couldn't communicate" in reason


def test_probe_without_driver(monkeypatch):
    monkeypatch.setenv("HIVEJET_NVIDIA_SMI", "")
    gpus, reason = fr.probe_gpus()
    assert gpus == [] and "no NVIDIA driver" in reason


def test_installed_torch_flavors():
    def versions(**d):
        return lambda name: d.get(name.replace("-", "_"))
    assert fr.installed_torch(versions()).version is None
    assert fr.installed_torch(versions(torch="2.9.1+cu128")).flavor == "cu128"
    assert fr.installed_torch(versions(torch="2.9.1+cpu")).flavor == "cpu"
    assert fr.installed_torch(versions(torch="2.9.1"), platform="win32").flavor == "cpu"
    b = fr.installed_torch(versions(torch="2.9.1", nvidia_cuda_runtime_cu12="12.8.90"), platform="linux")
    assert b.flavor == "cuda" and b.is_cuda


CPU = fr.TorchBuild("2.9.1+cpu", "cpu")
NONE = fr.TorchBuild(None, None)


@pytest.mark.parametrize("platform,cuda,compute,torch,triton", [
    ("linux", (13, 1), (8, 9), "torch==2.11.0+cu128", ""),
    ("linux", (12, 8), (7, 5), "torch==2.11.0+cu128", ""),           # upstream Triton runs Turing
    ("linux", (12, 6), (8, 9), "torch==2.9.1+cu126", ""),
    ("win32", (13, 0), (12, 0), "torch==2.11.0+cu128", "triton-windows==3.6.0.post26"),
    ("win32", (12, 6), (8, 6), "torch==2.9.1+cu126", "triton-windows==3.5.1.post24"),
    ("win32", (12, 8), (7, 5), "torch==2.6.0+cu126", "triton-windows==3.2.0.post21"),   # Turing: Triton <= 3.2
])
def test_choose_pinned_stack_for_gpu_and_driver(platform, cuda, compute, torch, triton):
    p = fr.choose([gpu(cuda=cuda, compute=compute)], "", CPU, platform=platform)
    assert (p.action, p.cpu_mode, p.torch_spec, p.triton_spec) == ("install", False, torch, triton)
    assert p.index == "https://download.pytorch.org/whl/" + p.flavor
    assert "RTX 4090" in p.message and p.download_mb > 1000


def test_windows_turing_replaces_a_cuda_build_whose_triton_does_not_support_it():
    turing = gpu(cuda=(12, 8), compute=(7, 5), name="RTX 2080")
    p = fr.choose([turing], "", fr.TorchBuild("2.11.0+cu128", "cu128"), platform="win32")
    assert (p.action, p.torch_spec) == ("install", "torch==2.6.0+cu126") and "Triton" in p.message
    assert fr.choose([turing], "", fr.TorchBuild("2.6.0+cu126", "cu126"), platform="win32").action == "none"
    # on Linux the same card keeps its CUDA build
    assert fr.choose([turing], "", fr.TorchBuild("2.11.0+cu128", "cu128"), platform="linux").action == "none"


def test_gpu_mode_is_not_offered_below_turing_on_any_platform():
    for platform in ("win32", "linux"):
        p = fr.choose([gpu(compute=(7, 0), name="Tesla V100")], "", CPU, platform=platform)
        assert p.cpu_mode and p.action == "none" and "7.5" in p.message


def test_choose_cpu_mode_with_clear_messages():
    p = fr.choose([], "no NVIDIA driver found (nvidia-smi is missing)", CPU)
    assert (p.action, p.cpu_mode) == ("none", True) and "CPU mode" in p.message and "nvidia-smi" in p.message
    p = fr.choose([], "no NVIDIA driver found", NONE)          # nothing installed yet: the CPU build
    assert (p.action, p.flavor) == ("install", "cpu")
    p = fr.choose([gpu(compute=(6, 1), name="GTX 1080")], "", CPU)
    assert p.cpu_mode and "GTX 1080" in p.message and "7.5" in p.message
    p = fr.choose([gpu(cuda=(12, 2), driver="535.1")], "", CPU)
    assert p.cpu_mode and "535.1" in p.message and "Update the driver" in p.message


def test_choose_keeps_a_fitting_cuda_build_and_replaces_one_too_new():
    assert fr.choose([gpu(cuda=(12, 8))], "", fr.TorchBuild("2.9.1+cu128", "cu128")).action == "none"
    assert fr.choose([gpu(cuda=(12, 8))], "", fr.TorchBuild("2.9.1", "cuda")).action == "none"
    p = fr.choose([gpu(cuda=(12, 6))], "", fr.TorchBuild("2.9.1+cu128", "cu128"))
    assert (p.action, p.flavor) == ("install", "cu126")


def test_choose_picks_the_largest_suitable_gpu():
    small, old = gpu(name="RTX 3060", mem=12288), gpu(name="GTX 980", compute=(5, 2), mem=40000)
    p = fr.choose([old, small], "", CPU)
    assert p.gpu.name == "RTX 3060"


def test_forced_flavor_takes_its_pinned_stack():
    p = fr.Plan("install", "cu126", gpu(compute=(7, 5)), "").pinned("win32")
    assert (p.torch_spec, p.triton_spec) == ("torch==2.6.0+cu126", "triton-windows==3.2.0.post21")
    p = fr.Plan("install", "cpu", None, "").pinned("linux")
    assert p.torch_spec == "torch==2.13.0+cpu" and p.index.endswith("/whl/cpu")
    with pytest.raises(ValueError, match="no pinned cu999"):
        fr.Plan("install", "cu999", None, "").pinned("linux")


class FakePip:
    """Records the commands; `download` drops fake wheels into --dest; fails the step named in fail."""

    def __init__(self, fail: str = "", cuda_ok: bool = True):
        self.calls: list[list[str]] = []
        self.fail, self.cuda_ok = fail, cuda_ok

    def __call__(self, argv, on_line):
        argv = list(argv)
        self.calls.append(argv)
        if "-c" in argv:
            on_line(f"torch 2.9.1+cu128 cuda {self.cuda_ok}")
            return 1 if self.fail == "check" else 0
        cmd = argv[3]
        if cmd == self.fail or (self.fail == "triton" and any(a.startswith("triton") for a in argv)):
            on_line("Looking in indexes: https://download.pytorch.org/whl/cu128")
            on_line("ERROR: HTTP error 503 while getting torch-2.9.1+cu128-cp312-cp312-win_amd64.whl")
            return 1
        if cmd == "download":
            dest = Path(argv[argv.index("--dest") + 1])
            if any(a.startswith("triton-windows") for a in argv):
                (dest / "triton_windows-3.5.1.post21-cp312-cp312-win_amd64.whl").write_bytes(b"")
            else:
                (dest / "torch-2.11.0+cu128-cp312-cp312-win_amd64.whl").write_bytes(b"")
                (dest / "sympy-1.14.0-py3-none-any.whl").write_bytes(b"")
            on_line("Progress 10 of 100")
        return 0


def test_run_setup_windows_cuda(tmp_path):
    plan = fr.choose([gpu()], "", CPU, platform="win32")
    pip, lines = FakePip(), []
    res = fr.run_setup(plan, python=str(tmp_path / "python" / "python.exe"), cache=tmp_path / "cache", runner=pip,
                       on_line=lines.append, platform="win32", raw_progress=True, resume=True)
    assert res.ok and res.gpu_ready and res.torch_version == "2.11.0+cu128"
    dl_torch, dl_triton, install, check = pip.calls
    assert dl_torch[3:5] == ["download", "--only-binary=:all:"]
    assert "https://download.pytorch.org/whl/cu128" in dl_torch and "torch==2.11.0+cu128" in dl_torch
    assert "--progress-bar" in dl_torch and dl_torch[dl_torch.index("--resume-retries") + 1] == "20"
    assert "triton-windows==3.6.0.post26" in dl_triton and "--index-url" not in dl_triton   # from PyPI
    assert install[3] == "install" and "--no-index" in install
    assert "torch==2.11.0+cu128" in install and "triton-windows==3.6.0.post26" in install
    assert [ln for ln in lines if ln.startswith("@@step")] == [
        "@@step 1 4 Downloading PyTorch (2.11.0+cu128, CUDA)", "@@step 2 4 Downloading Triton for Windows",
        "@@step 3 4 Installing PyTorch (2.11.0+cu128, CUDA)", "@@step 4 4 Checking PyTorch"]
    assert lines[-1].startswith("@@result ok GPU support is ready")
    assert (tmp_path / "cache").exists()          # kept on Windows: an upgrade reinstalls without downloading


def test_run_setup_linux_cpu_has_no_triton_step_and_drops_the_download(tmp_path):
    plan = fr.Plan("install", "cpu", None, "", cpu_mode=True)
    pip = FakePip()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    res = fr.run_setup(plan, python=str(venv / "bin" / "python"), runner=pip, on_line=lambda s: None,
                       platform="linux", raw_progress=False, resume=False)
    assert res.ok and not res.gpu_ready and "CPU mode" in res.message
    assert len(pip.calls) == 3 and "https://download.pytorch.org/whl/cpu" in pip.calls[0]
    assert "torch==2.13.0+cpu" in pip.calls[0]
    assert "--progress-bar" not in pip.calls[0] and "--resume-retries" not in pip.calls[0]
    assert not (tmp_path / "gpu-cache" / "cpu").exists()
    assert json.loads((venv / "hivejet-gpu.json").read_text())["flavor"] == "cpu"


@pytest.mark.parametrize("step,ok,text", [("download", False, "nothing was changed"),
                                          ("triton", False, "nothing was changed"),
                                          ("install", False, "Installing"),
                                          ("check", False, "does not import")])
def test_run_setup_failures_are_explained(tmp_path, step, ok, text):
    plan = fr.choose([gpu()], "", CPU, platform="win32")
    pip = FakePip(fail=step)
    lines = []
    res = fr.run_setup(plan, python="python", cache=tmp_path, runner=pip, on_line=lines.append, platform="win32",
                       raw_progress=False, resume=False)
    assert res.ok is ok and not res.gpu_ready and text in res.message
    if step in ("download", "triton"):
        assert not any(c[3] == "install" for c in pip.calls if len(c) > 3)
    if step != "check":     # the failing step's own error text, not only its exit code
        assert "HTTP error 503 while getting" in res.message and "@@step" not in res.message
        result = lines[-1]
        assert result.startswith("@@result fail") and "\n" not in result and "HTTP error 503" in result


def test_stopped_message_quotes_pkexec():
    msg = fr.stopped_message(["/usr/bin/pkexec", "py"], 126, ["Error executing command as another user: Not authorized"])
    assert "authorization refused" in msg and "Not authorized" in msg
    msg = fr.stopped_message(["/usr/bin/pkexec", "py"], 127, ["Error: no authentication agent found."])
    assert "sudo hivejet-gpu-setup" in msg and "no authentication agent" in msg
    assert fr.stopped_message(["py"], 3, ["Traceback ...", "OSError: disk full"]).endswith("OSError: disk full")


def test_run_setup_cuda_build_that_does_not_see_the_gpu(tmp_path):
    res = fr.run_setup(fr.choose([gpu()], "", CPU), python="python", cache=tmp_path, runner=FakePip(cuda_ok=False),
                       on_line=lambda s: None, platform="linux", raw_progress=False, resume=False)
    assert res.ok and not res.gpu_ready and "CPU mode" in res.message


def test_declined_is_remembered_per_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("HIVEJET_HOME", str(tmp_path))
    plan = fr.choose([gpu(driver="570.1")], "", CPU)
    assert not fr.declined(plan)
    fr.remember_cpu_choice(plan)
    assert fr.declined(plan)
    assert not fr.declined(fr.choose([gpu(driver="580.2")], "", CPU))   # a new driver: ask again


def test_setup_command_and_cli_nothing_to_do(monkeypatch, capsys):
    cmd = fr.setup_command("cu128", python="py")
    assert cmd == ["py", "-m", "app.firstrun", "setup", "--yes", "--flavor", "cu128", "--progress", "raw"]
    monkeypatch.setenv("HIVEJET_NVIDIA_SMI", "")
    assert fr.main(["setup", "--yes"]) == 0            # CI: no GPU, torch installed -> nothing to do
    out = capsys.readouterr().out
    assert "@@result ok nothing to do" in out and "CPU mode" in out
    assert fr.main(["plan"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_mode"] is True


# ------------------------------------------------------------------------------------------ progress window
FAKE_SETUP = r"""
import sys, time
for line in ["@@step 1 3 Downloading PyTorch (cu128 build, CUDA)", "Progress 500000000 of 1000000000",
             "Collecting torch", "@@step 3 3 Checking PyTorch", "@@result %s"]:
    print(line, flush=True)
    time.sleep(0.02)
sys.exit(%d)
"""


@pytest.mark.parametrize("ok", [True, False])
def test_progress_dialog_runs_the_setup_and_reports(qtbot, tmp_path, ok):
    pytest.importorskip("PySide6")
    script = tmp_path / "fake_setup.py"
    result = "ok GPU support is ready" if ok else "fail Downloading failed; nothing was changed"
    script.write_text(FAKE_SETUP % (result, 0 if ok else 1))
    dlg = fr.make_progress_dialog([sys.executable, str(script)])
    qtbot.addWidget(dlg)
    seen = []
    dlg.proc.readyReadStandardOutput.connect(lambda: seen.append((dlg.bar.maximum(), dlg.bar.value())))
    with qtbot.waitSignal(dlg.finished, timeout=20000):
        dlg.start()
        dlg.show()
    assert dlg.result_ok is ok
    assert dlg.result_message == result.split(" ", 1)[1]
    assert "Collecting torch" in dlg.log.toPlainText()
    assert dlg.step_label.text().startswith("Step 3 of 3")


def test_progress_dialog_parses_pip_raw_progress(qtbot):
    dlg = fr.make_progress_dialog([sys.executable, "-c", "pass"])
    qtbot.addWidget(dlg)
    dlg.handle_line("@@step 1 3 Downloading PyTorch")
    assert dlg.bar.maximum() == 0                       # busy until pip reports sizes
    dlg.handle_line("Progress 250000000 of 1000000000")
    assert (dlg.bar.maximum(), dlg.bar.value()) == (1000, 250) and "250 MB of 1,000 MB" in dlg.detail.text()


def test_progress_dialog_missing_command(qtbot):
    dlg = fr.make_progress_dialog(["/nonexistent/hivejet-setup"])
    qtbot.addWidget(dlg)
    with qtbot.waitSignal(dlg.finished, timeout=10000):
        dlg.start()
    assert not dlg.result_ok and "Could not start" in dlg.result_message


# ------------------------------------------------------------------------------------------ launch
def test_launch_sets_up_before_opening_the_app(monkeypatch, tmp_path):
    monkeypatch.setenv("HIVEJET_HOME", str(tmp_path))
    order = []
    plan = fr.choose([gpu()], "", CPU)
    monkeypatch.setattr(fr, "current_plan", lambda smi=None: plan)
    monkeypatch.setattr(fr, "ask_and_setup", lambda p, **k: (order.append(("setup", p.flavor)), (True, "ok"))[1])
    import app.gui
    monkeypatch.setattr(app.gui, "run_gui", lambda model=None, smoke=False: order.append(("gui", model, smoke)) or 0)
    assert fr.launch(["-m", "x.gguf"]) == 0
    assert order == [("setup", "cu128"), ("gui", "x.gguf", False)]
    order.clear()
    assert fr.launch(["--smoke"]) == 0                  # the smoke test never asks
    assert order == [("gui", None, True)]
    order.clear()
    fr.remember_cpu_choice(plan)                        # "Always use the CPU"
    assert fr.launch([]) == 0 and order == [("gui", None, False)]


def test_ask_and_setup_shows_the_error_and_retries(qtbot, tmp_path, monkeypatch):
    shown = []
    answers = []
    monkeypatch.setattr(fr, "show_failure", lambda msg: shown.append(msg) or (answers.pop(0) if answers else False))
    script = tmp_path / "s.py"
    plan = fr.choose([gpu()], "", CPU)
    script.write_text(FAKE_SETUP % ("ok GPU support is ready", 0))
    assert fr.ask_and_setup(plan, command=[sys.executable, str(script)], ask=False) == (True, "GPU support is ready")
    assert shown == []
    script.write_text(FAKE_SETUP % ("fail Downloading failed\\\\n\\\\nERROR: HTTP error 503", 1))  # as run_setup escapes it
    assert fr.ask_and_setup(plan, command=[sys.executable, str(script)], ask=False) == (
        False, "Downloading failed\n\nERROR: HTTP error 503")
    assert shown == ["Downloading failed\n\nERROR: HTTP error 503"]
    # Retry runs the setup again: the second run succeeds
    shown.clear()
    answers.append(True)
    runs = tmp_path / "runs"
    script.write_text("import sys, pathlib\n"
                      f"p = pathlib.Path({str(runs)!r}); n = int(p.read_text()) if p.exists() else 0\n"
                      "p.write_text(str(n + 1))\n"
                      "print('@@result ok GPU support is ready' if n else 'pip: ERROR: no space left on device')\n"
                      "sys.exit(0 if n else 1)\n")
    assert fr.ask_and_setup(plan, command=[sys.executable, str(script)], ask=False) == (True, "GPU support is ready")
    assert len(shown) == 1 and "exit code 1" in shown[0] and "no space left on device" in shown[0]


def test_start_check_names_the_missing_vc_runtime():
    def broken(name):
        raise OSError('[WinError 126] The specified module could not be found. Error loading "C:\\HiveJet\\python\\'
                      'Lib\\site-packages\\torch\\lib\\c10.dll" or one of its dependencies.')
    msg = fr.torch_import_error(broken, platform="win32")
    assert "c10.dll" in msg and "MSVCP140.dll" in msg and "installer again" in msg and fr.VC_REDIST_URL in msg
    assert "setup-env.sh" in fr.torch_import_error(broken, platform="linux")
    assert fr.torch_import_error(lambda name: None) == ""


def test_launch_stops_with_the_message_when_torch_does_not_import(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HIVEJET_HOME", str(tmp_path))
    monkeypatch.setattr(fr, "current_plan", lambda smi=None: fr.choose([], "no NVIDIA driver found", CPU))
    monkeypatch.setattr(fr, "torch_import_error", lambda: "PyTorch could not be loaded (OSError: c10.dll).")
    import app.gui
    monkeypatch.setattr(app.gui, "display_available", lambda: False)
    monkeypatch.setattr(app.gui, "run_gui", lambda *a, **k: pytest.fail("the app must not open"))
    assert fr.launch([]) == 1
    assert "c10.dll" in capsys.readouterr().err


def test_failed_setup_keeps_the_download_for_the_retry(tmp_path):
    """Linux drops the download folder only after a successful install: a retry skips the wheels already there."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    plan = fr.choose([gpu()], "", CPU, platform="linux")
    res = fr.run_setup(plan, python=str(venv / "bin" / "python"), runner=FakePip(fail="install"),
                       on_line=lambda s: None, platform="linux", raw_progress=False, resume=False)
    cache = tmp_path / "gpu-cache" / "cu128"
    assert not res.ok and any(cache.glob("torch-*.whl"))
    res = fr.run_setup(plan, python=str(venv / "bin" / "python"), runner=FakePip(), on_line=lambda s: None,
                       platform="linux", raw_progress=False, resume=False)
    assert res.ok and not cache.exists()
