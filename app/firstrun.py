"""First-run GPU setup of an installed HiveJet (the Windows installer and the Linux .deb).

The installers put HiveJet into a private Python environment (`sys.prefix`: %LOCALAPPDATA%\\Programs\\HiveJet\\python
on Windows, /opt/hivejet/venv on Linux). PyTorch comes in one of several builds, and which one fits depends on
the machine: a CUDA build matching the NVIDIA driver, or the CPU build. This module picks and installs it:

* `probe_gpus()` asks `nvidia-smi` for each GPU's name, driver, the CUDA version the driver supports and its
  compute capability ([] plus a reason when there is no NVIDIA driver).
* `installed_torch()` reads which torch build the environment holds, without importing torch (so that it can
  still be replaced: Windows locks the DLLs of a loaded torch).
* `choose()` turns those two into a Plan: nothing to do, or install the `cu130`/`cu128`/`cu126`/`cpu` build,
  with the message the user sees (CPU mode and why, when there is no suitable GPU).
* `run_setup()` carries a plan out in three steps: download the wheels (nothing is changed if this fails), install
  them offline from that download, check that torch imports and sees the GPU. On Windows triton-windows comes
  with the CUDA build (on Linux the CUDA torch wheels depend on triton themselves).
* `launch()` is what the desktop entry and the Start menu shortcut run: it checks the plan, shows a progress
  window while the setup runs (elevated through pkexec when the environment is not the user's to write, as
  under /opt on Linux), then opens the app in the same process; torch is first imported after the setup.

Everything that touches the network or the environment goes through an injectable `runner` (argv, on_line) -> rc,
and `nvidia-smi` through `HIVEJET_NVIDIA_SMI` or the `smi` argument, so the tests run without network or GPU.
This module imports only the standard library at load time (it runs before the app's dependencies exist).

Command line: `python -m app.firstrun plan | setup [--yes] [--flavor F] | launch [gui args...]`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

TORCH_INDEX = os.environ.get("HIVEJET_TORCH_INDEX", "https://download.pytorch.org/whl")
TORCH_SPEC = "torch>=2.6"
# CUDA builds of torch, newest first: (the driver's CUDA version it needs, build tag).
CUDA_BUILDS: list[tuple[tuple[int, int], str]] = [((13, 0), "cu130"), ((12, 8), "cu128"), ((12, 6), "cu126")]
MIN_CUDA = CUDA_BUILDS[-1][0]
MIN_COMPUTE = (7, 5)          # Turing or newer: what Triton (and HiveJet's kernels) support
# triton-windows releases follow torch's: torch 2.N needs triton-windows 3.(N-4).x (2.7 -> 3.3, 2.9 -> 3.5).
TRITON_WINDOWS = "triton-windows"
SIZES_MB = {"cuda": 2800, "cpu": 200}   # rough download sizes, for the question the user is asked

Runner = Callable[[Sequence[str], Callable[[str], None]], int]


# ----------------------------------------------------------------------------------------------- GPU probe
@dataclass
class GpuProbe:
    name: str
    driver: str
    cuda: tuple[int, int] | None       # the CUDA version the driver supports
    compute: tuple[int, int] | None    # compute capability, None where the driver does not report it
    memory_mib: int = 0


def _ver2(s: str) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", s or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _smi_path() -> str | None:
    env = os.environ.get("HIVEJET_NVIDIA_SMI")
    if env is not None:
        return env if env and Path(env).exists() else None
    found = shutil.which("nvidia-smi")
    if found:
        return found
    if sys.platform == "win32":
        for p in (Path(os.environ.get("SystemRoot", r"C:\Windows")) / "System32" / "nvidia-smi.exe",
                  Path(os.environ.get("ProgramFiles", r"C:\Program Files")) / "NVIDIA Corporation" / "NVSMI"
                  / "nvidia-smi.exe"):
            if p.exists():
                return str(p)
    return None


def _run_capture(argv: Sequence[str], timeout: float = 20) -> tuple[int, str]:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                           creationflags=_NO_WINDOW)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return p.returncode, (p.stdout or "") + (p.stderr or "")


_NO_WINDOW = getattr(subprocess, "CREATE_NO_WINDOW", 0)   # no console flashing under pythonw on Windows


def parse_smi(query_csv: str, banner: str) -> list[GpuProbe]:
    """Parse `nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader,nounits`
    and the plain `nvidia-smi` banner (the only place older drivers state their CUDA version)."""
    m = re.search(r"CUDA Version\s*:\s*([\d.]+)", banner)
    cuda = _ver2(m.group(1)) if m else None
    out = []
    for line in query_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0] or parts[0].lower().startswith("name"):
            continue
        mem = int(parts[2]) if parts[2].isdigit() else 0
        compute = _ver2(parts[3]) if len(parts) > 3 else None
        out.append(GpuProbe(parts[0], parts[1], cuda, compute, mem))
    return out


def probe_gpus(smi: str | None = None, capture=_run_capture) -> tuple[list[GpuProbe], str]:
    """(gpus, reason): reason says why the list is empty."""
    smi = smi if smi is not None else _smi_path()
    if not smi:
        return [], "no NVIDIA driver found (nvidia-smi is missing)"
    rc, q = capture([smi, "--query-gpu=name,driver_version,memory.total,compute_cap",
                     "--format=csv,noheader,nounits"])
    if rc != 0:   # drivers older than 510 do not know compute_cap
        rc, q = capture([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"])
    if rc != 0:
        first = (q.strip().splitlines() or ["nvidia-smi failed"])[0]
        return [], f"the NVIDIA driver is not working ({first})"
    _, banner = capture([smi])
    gpus = parse_smi(q, banner)
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


# ----------------------------------------------------------------------------------------------- torch build
@dataclass
class TorchBuild:
    version: str | None      # None: torch is not installed
    flavor: str | None       # "cpu", "cu128", "cuda" (a CUDA build whose tag is not in its version), None

    @property
    def is_cuda(self) -> bool:
        return bool(self.flavor) and self.flavor != "cpu"


def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_torch(version_of: Callable[[str], str | None] = _dist_version,
                    platform: str = sys.platform) -> TorchBuild:
    v = version_of("torch")
    if v is None:
        return TorchBuild(None, None)
    local = v.partition("+")[2]
    if local:
        return TorchBuild(v, "cpu" if local.startswith("cpu") else local if local.startswith("cu") else "cpu")
    # No local tag: PyPI's own builds. Linux x86_64/aarch64 ones are CUDA builds (they pull nvidia-* wheels),
    # Windows and macOS ones are CPU builds.
    if platform.startswith("linux") and (version_of("nvidia-cuda-runtime-cu12") or version_of("nvidia-cuda-runtime")
                                         or version_of("nvidia-cuda-runtime-cu13")):
        return TorchBuild(v, "cuda")
    return TorchBuild(v, "cpu")


def _tag_cuda(flavor: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"cu(\d+)(\d)", flavor or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


# ----------------------------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    action: str                   # "none" or "install"
    flavor: str                   # the build that fits: "cpu" or a CUDA tag
    gpu: GpuProbe | None
    message: str                  # what the user is told
    cpu_mode: bool = False        # True: no suitable GPU, HiveJet runs on the CPU
    download_mb: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def suitable(gpu: GpuProbe) -> str:
    """'' when HiveJet's GPU build runs on `gpu`, else why not."""
    if gpu.compute is not None and gpu.compute < MIN_COMPUTE:
        return (f"the {gpu.name} (compute capability {gpu.compute[0]}.{gpu.compute[1]}) is older than what "
                f"HiveJet's GPU kernels need ({MIN_COMPUTE[0]}.{MIN_COMPUTE[1]}: GeForce RTX 20 / Turing or newer)")
    if gpu.cuda is None or gpu.cuda < MIN_CUDA:
        have = f"CUDA {gpu.cuda[0]}.{gpu.cuda[1]}" if gpu.cuda else "an unknown CUDA version"
        return (f"NVIDIA driver {gpu.driver} supports {have}; HiveJet's GPU build needs CUDA "
                f"{MIN_CUDA[0]}.{MIN_CUDA[1]} or newer. Update the driver (nvidia.com/drivers) and start HiveJet "
                "again to use the GPU")
    return ""


def cuda_flavor(cuda: tuple[int, int]) -> str:
    for need, tag in CUDA_BUILDS:
        if cuda >= need:
            return tag
    raise ValueError(f"no CUDA build for CUDA {cuda}")


def choose(gpus: list[GpuProbe], reason: str, torch: TorchBuild) -> Plan:
    """What to install, given the GPUs and the torch build in the environment."""
    good = [g for g in gpus if not suitable(g)]
    if not good:
        why = suitable(max(gpus, key=lambda g: g.memory_mib)) if gpus else reason or "no NVIDIA GPU found"
        msg = f"No suitable NVIDIA GPU: HiveJet runs in CPU mode ({why}). Small models run well on the CPU."
        if torch.version:      # any build runs on the CPU, a CUDA one too
            return Plan("none", torch.flavor or "cpu", None, msg, cpu_mode=True)
        return Plan("install", "cpu", None, msg + " Installing the CPU build of PyTorch.", cpu_mode=True,
                    download_mb=SIZES_MB["cpu"])
    gpu = max(good, key=lambda g: g.memory_mib)
    want = cuda_flavor(gpu.cuda)
    if torch.is_cuda:
        have = _tag_cuda(torch.flavor)
        if have is None or have <= gpu.cuda:  # an untagged (PyPI) CUDA build, or one the driver runs
            return Plan("none", torch.flavor, gpu, f"GPU mode: {gpu.name} (torch {torch.version}).")
        msg = (f"The installed PyTorch ({torch.version}) needs a newer driver than {gpu.driver}: installing the "
               f"{want} build for your {gpu.name}.")
    elif torch.version:
        msg = (f"Found {gpu.name} ({gpu.memory_mib // 1024} GiB, driver {gpu.driver}). GPU support needs the "
               f"CUDA build of PyTorch ({want}, about {SIZES_MB['cuda'] / 1000:.1f} GB to download once); until "
               "then HiveJet runs in CPU mode.")
    else:
        msg = f"Found {gpu.name}: installing the CUDA build of PyTorch ({want})."
    return Plan("install", want, gpu, msg, download_mb=SIZES_MB["cuda"])


def current_plan(smi: str | None = None) -> Plan:
    gpus, reason = probe_gpus(smi)
    return choose(gpus, reason, installed_torch())


# ----------------------------------------------------------------------------------------------- running pip
def subprocess_runner(argv: Sequence[str], on_line: Callable[[str], None]) -> int:
    """Run argv, passing each output line (stdout and stderr merged) to on_line; returns the exit code."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace", bufsize=1, env=env, creationflags=_NO_WINDOW)
    except OSError as e:
        on_line(f"cannot run {argv[0]}: {e}")
        return 127
    assert p.stdout is not None
    for line in p.stdout:
        on_line(line.rstrip("\r\n"))
    return p.wait()


def terminal_runner(argv: Sequence[str], on_line: Callable[[str], None]) -> int:
    """Run argv on this process's terminal (pip draws its own progress bar); output is not captured."""
    try:
        return subprocess.call(list(argv), creationflags=_NO_WINDOW)
    except OSError as e:
        on_line(f"cannot run {argv[0]}: {e}")
        return 127


def pip_supports_raw_progress(python: str, capture=_run_capture) -> bool:
    rc, out = capture([python, "-m", "pip", "--version"])
    m = re.search(r"pip (\d+)\.(\d+)", out)
    return rc == 0 and bool(m) and (int(m.group(1)), int(m.group(2))) >= (24, 1)


@dataclass
class SetupResult:
    ok: bool
    gpu_ready: bool
    message: str
    torch_version: str = ""
    log: list[str] = field(default_factory=list)


def wheel_version(cache: Path, project: str) -> str | None:
    """The version of the newest `project` wheel in cache (pip download's result)."""
    norm = project.replace("-", "_").lower()
    best = None
    for f in cache.glob("*.whl"):
        name, _, rest = f.name.partition("-")
        if name.lower() == norm:
            v = rest.split("-")[0]
            if best is None or f.stat().st_mtime > best[1]:
                best = (v, f.stat().st_mtime)
    return best[0] if best else None


def triton_windows_spec(torch_version: str) -> str:
    m = re.match(r"2\.(\d+)", torch_version)
    if not m or int(m.group(1)) < 6:
        return TRITON_WINDOWS
    minor = int(m.group(1)) - 4
    return f"{TRITON_WINDOWS}>=3.{minor},<3.{minor + 1}"


def run_setup(plan: Plan, *, python: str = sys.executable, cache: Path | None = None, runner: Runner = subprocess_runner,
              on_line: Callable[[str], None] = print, pip_args: Sequence[str] = (), platform: str = sys.platform,
              raw_progress: bool | None = None, check_runner: Runner | None = None) -> SetupResult:
    """Download and install the torch build `plan.flavor` into `python`'s environment. Steps are announced as
    `@@step K N title` lines, pip's progress as `Progress X of Y` (pip >= 24.1), the end as `@@result ok|fail`.
    `runner` runs the pip steps, `check_runner` (default: `runner`) the final import check, whose output it reads."""
    check_runner = check_runner or runner
    log: list[str] = []

    def say(line: str) -> None:
        log.append(line)
        on_line(line)

    def done(ok: bool, gpu_ready: bool, msg: str, tv: str = "") -> SetupResult:
        say(f"@@result {'ok' if ok else 'fail'} {msg}")
        return SetupResult(ok, gpu_ready, msg, tv, log)

    cuda = plan.flavor != "cpu"
    win = platform == "win32"
    # Default download folder: next to the environment, so that a Windows upgrade (which replaces the
    # environment) installs the GPU build again without downloading it again. Linux keeps its venv across
    # upgrades and drops the download once installed.
    keep = cache is not None or win
    cache = Path(cache) if cache else _env_prefix(python).parent / "gpu-cache" / plan.flavor
    cache.mkdir(parents=True, exist_ok=True)
    if raw_progress is None:
        raw_progress = pip_supports_raw_progress(python)
    progress = ["--progress-bar", "raw"] if raw_progress else []
    pip = [python, "-m", "pip"]
    index = f"{TORCH_INDEX}/{plan.flavor}"
    total = 4 if cuda and win else 3
    what = f"PyTorch ({plan.flavor} build" + (", CUDA" if cuda else "") + ")"

    say(f"@@step 1 {total} Downloading {what}")
    rc = runner(pip + ["download", "--only-binary=:all:", "--dest", str(cache), "--index-url", index, TORCH_SPEC,
                       *progress, *pip_args], say)
    tv = wheel_version(cache, "torch")
    if rc != 0 or not tv:
        return done(False, False, f"Downloading {what} failed (exit {rc}); nothing was changed. "
                    "Check the internet connection and start HiveJet again. HiveJet runs in CPU mode until then.")
    extra: list[str] = []
    if cuda and win:
        say(f"@@step 2 {total} Downloading Triton for Windows")
        rc = runner(pip + ["download", "--only-binary=:all:", "--dest", str(cache), triton_windows_spec(tv),
                           *progress, *pip_args], say)
        trv = wheel_version(cache, TRITON_WINDOWS)
        if rc != 0 or not trv:
            return done(False, False, f"Downloading triton-windows failed (exit {rc}); nothing was changed. "
                        "HiveJet runs in CPU mode until the next try.")
        extra = [f"{TRITON_WINDOWS}=={trv}"]
    say(f"@@step {total - 1} {total} Installing {what}")
    rc = runner(pip + ["install", "--no-index", "--find-links", str(cache), "--upgrade", f"torch=={tv}", *extra,
                       "--no-warn-script-location", *pip_args], say)
    if rc != 0:
        return done(False, False, f"Installing {what} failed (exit {rc}). Run the setup again "
                    "(see docs/INSTALL.md); HiveJet may not start until it succeeds.", tv)
    say(f"@@step {total} {total} Checking PyTorch")
    out: list[str] = []
    rc = check_runner([python, "-c", "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"],
                lambda s: (out.append(s), say(s)))
    text = " ".join(out)
    if rc != 0:
        return done(False, False, f"PyTorch {tv} does not import: {text[-300:]}", tv)
    if cuda and "cuda True" not in text:
        return done(True, False, f"PyTorch {tv} is installed but does not see the GPU ({text[-200:]}): "
                    "HiveJet runs in CPU mode. A reboot after a driver update often fixes this.", tv)
    if not keep:
        shutil.rmtree(cache, ignore_errors=True)
    _write_state(python, {"flavor": plan.flavor, "torch": tv, "gpu": plan.gpu.name if plan.gpu else None,
                          "driver": plan.gpu.driver if plan.gpu else None, "time": time.time()})
    if cuda:
        return done(True, True, f"GPU support is ready: PyTorch {tv} on {plan.gpu.name if plan.gpu else 'the GPU'}.",
                    tv)
    return done(True, False, f"PyTorch {tv} (CPU build) is installed: HiveJet runs in CPU mode.", tv)


def _env_prefix(python: str) -> Path:
    """The environment folder of a python executable (venv/bin/python -> venv; python\\python.exe -> python)."""
    d = Path(python).absolute().parent
    return d.parent if d.name.lower() in ("bin", "scripts") else d


def _write_state(python: str, state: dict) -> None:
    """<env>/hivejet-gpu.json: what the last setup installed (for support questions)."""
    try:
        (_env_prefix(python) / "hivejet-gpu.json").write_text(json.dumps(state, indent=1))
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------- per-user choice
def _user_dir() -> Path:
    env = os.environ.get("HIVEJET_HOME")
    if env:
        return Path(env)
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / "hivejet" / "hivejet"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "hivejet"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "hivejet"


def _choice_file() -> Path:
    return _user_dir() / "gpu-setup.json"


def declined(plan: Plan) -> bool:
    """The user chose 'always use the CPU' for this GPU and driver."""
    try:
        d = json.loads(_choice_file().read_text())
    except (OSError, ValueError):
        return False
    return d.get("choice") == "cpu" and plan.gpu is not None and d.get("driver") == plan.gpu.driver


def remember_cpu_choice(plan: Plan) -> None:
    f = _choice_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"choice": "cpu", "driver": plan.gpu.driver if plan.gpu else None}))


def env_writable(prefix: str = sys.prefix) -> bool:
    """Whether this user can install into the environment (no on Linux /opt/hivejet/venv unless root)."""
    sp = Path(prefix)
    dirs = [sp, *sp.glob("lib*/python*/site-packages"), *sp.glob("Lib/site-packages")]
    return all(os.access(d, os.W_OK) for d in dirs)


def setup_command(flavor: str, python: str = sys.executable, elevate: bool = False) -> list[str]:
    """The command the progress window runs: this module's `setup` in a child process (through pkexec when the
    environment belongs to root)."""
    cmd = [python, "-m", "app.firstrun", "setup", "--yes", "--flavor", flavor, "--progress", "raw"]
    if elevate:
        pk = shutil.which("pkexec")
        if not pk:
            raise PermissionError("pkexec is missing")
        cmd = [pk] + cmd
    return cmd


# ----------------------------------------------------------------------------------------------- progress window
def make_progress_dialog(command: Sequence[str], title: str = "Setting up GPU support"):
    """A Qt dialog that runs `command` (a `setup` child process) and shows its steps, pip's download progress and
    its log; `dialog.result_ok`/`dialog.result_message` hold the outcome once it closes. Needs a QApplication."""
    from PySide6.QtCore import QProcess, Qt
    from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QProgressBar,
                                   QVBoxLayout)

    class ProgressDialog(QDialog):
        def __init__(self):
            super().__init__()
            self.setWindowTitle(f"HiveJet - {title}")
            self.setMinimumWidth(560)
            v = QVBoxLayout(self)
            self.step_label = QLabel("Starting…")
            self.step_label.setWordWrap(True)
            self.bar = QProgressBar()
            self.bar.setRange(0, 0)
            self.detail = QLabel("")
            self.log = QPlainTextEdit()
            self.log.setReadOnly(True)
            self.log.setMaximumBlockCount(2000)
            self.log.setMinimumHeight(140)
            self.buttons = QDialogButtonBox(QDialogButtonBox.Cancel)
            self.buttons.rejected.connect(self._cancel)
            for w in (self.step_label, self.bar, self.detail, self.log, self.buttons):
                v.addWidget(w)
            self.result_ok = False
            self.result_message = ""
            self.step = (0, 1)
            self._buf = ""
            self.proc = QProcess(self)
            self.proc.setProcessChannelMode(QProcess.MergedChannels)
            self.proc.readyReadStandardOutput.connect(self._read)
            self.proc.finished.connect(self._finished)
            self.proc.errorOccurred.connect(self._error)
            self._command = list(command)
            self._finished_called = False

        def start(self):
            from PySide6.QtCore import QProcessEnvironment
            env = QProcessEnvironment.systemEnvironment()
            env.insert("PYTHONUNBUFFERED", "1")
            self.proc.setProcessEnvironment(env)
            self.proc.start(self._command[0], self._command[1:])

        def _read(self):
            self._buf += bytes(self.proc.readAllStandardOutput()).decode("utf-8", "replace")
            *lines, self._buf = re.split(r"\r?\n|\r", self._buf)
            for line in lines:
                self.handle_line(line)

        def handle_line(self, line: str):
            if line.startswith("@@step "):
                k, n, text = (line[7:].split(" ", 2) + [""])[:3]
                self.step = (int(k), int(n))
                self.step_label.setText(f"Step {k} of {n}: {text}")
                self.bar.setRange(0, 0)
                self.detail.setText("")
            elif line.startswith("@@result "):
                status, _, msg = line[9:].partition(" ")
                self.result_ok = status == "ok"
                self.result_message = msg
            else:
                m = re.match(r"Progress (\d+) of (\d+)", line)
                if m and int(m.group(2)) > 0:
                    cur, tot = int(m.group(1)), int(m.group(2))
                    self.bar.setRange(0, 1000)
                    self.bar.setValue(int(1000 * cur / tot))
                    self.detail.setText(f"{cur / 1e6:,.0f} MB of {tot / 1e6:,.0f} MB")
                    return
                if line.strip():
                    self.log.appendPlainText(line)

        def _finished(self, code, _status=None):
            if self._finished_called:
                return
            self._finished_called = True
            if self._buf:
                self.handle_line(self._buf)
                self._buf = ""
            if not self.result_message:
                self.result_ok = False
                self.result_message = f"The setup stopped (exit code {code})."
            self.accept() if self.result_ok else self.reject()

        def _error(self, err):
            if err == QProcess.FailedToStart:
                self.result_message = f"Could not start the setup ({self._command[0]})."
                self._finished(127)

        def _cancel(self):
            if self.proc.state() != QProcess.NotRunning:
                self.proc.kill()
                self.proc.waitForFinished(3000)
            self.result_ok = False
            self.result_message = "GPU setup cancelled: HiveJet runs in CPU mode for now."
            self._finished_called = True
            self.reject()

    d = ProgressDialog()
    d.setAttribute(Qt.WA_DeleteOnClose, False)
    return d


def ask_and_setup(plan: Plan, *, command: Sequence[str] | None = None, ask: bool = True) -> tuple[bool, str]:
    """The GUI part of the first run: ask, run the setup with a progress window, say how it went.
    Returns (changed, message). Needs a QApplication."""
    from PySide6.QtWidgets import QMessageBox
    if ask:
        box = QMessageBox()
        box.setWindowTitle("HiveJet - GPU setup")
        box.setIcon(QMessageBox.Question)
        box.setText(plan.message)
        yes = box.addButton(f"Download GPU support ({plan.download_mb / 1000:.1f} GB)" if plan.flavor != "cpu"
                            else "Install", QMessageBox.AcceptRole)
        later = box.addButton("Not now", QMessageBox.RejectRole)
        never = box.addButton("Always use the CPU", QMessageBox.DestructiveRole) if plan.gpu else None
        box.setDefaultButton(yes)
        box.exec()
        if box.clickedButton() is never:
            remember_cpu_choice(plan)
            return False, "HiveJet runs in CPU mode (GPU setup turned off for this driver)."
        if box.clickedButton() is not yes:
            _ = later
            return False, "HiveJet runs in CPU mode for now; it asks again at the next start."
    if command is None:
        elevate = not env_writable()
        try:
            command = setup_command(plan.flavor, elevate=elevate)
        except PermissionError:
            msg = ("GPU setup needs administrator rights here. Run in a terminal:\n\n    sudo hivejet-gpu-setup\n\n"
                   "HiveJet runs in CPU mode until then.")
            QMessageBox.information(None, "HiveJet - GPU setup", msg)
            return False, msg
    dlg = make_progress_dialog(command)
    dlg.start()
    dlg.exec()
    if not dlg.result_ok:
        QMessageBox.warning(None, "HiveJet - GPU setup", dlg.result_message)
    return dlg.result_ok, dlg.result_message


# ----------------------------------------------------------------------------------------------- entry points
def launch(argv: Sequence[str] = (), smi: str | None = None) -> int:
    """Desktop entry / Start menu: first-run GPU check and setup, then the app. argv: [-m MODEL] [--smoke]."""
    p = argparse.ArgumentParser(prog="hivejet-launch")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--smoke", action="store_true", help="open the main window for a second, then exit 0")
    a = p.parse_args(list(argv))
    if sys.stdout is None or sys.stderr is None:   # pythonw (the Windows shortcuts) has no console: keep a log
        try:
            _user_dir().mkdir(parents=True, exist_ok=True)
            log = open(_user_dir() / "hivejet.log", "a", buffering=1, encoding="utf-8")
            sys.stdout = sys.stdout or log
            sys.stderr = sys.stderr or log
        except OSError:
            pass
    plan = current_plan(smi)
    from app.gui import display_available
    gui = display_available()
    if plan.action == "install" and not declined(plan) and not a.smoke:
        if gui:
            from PySide6.QtWidgets import QApplication
            app = QApplication.instance() or QApplication(sys.argv[:1])
            app.setApplicationName("HiveJet")
            _changed, msg = ask_and_setup(plan)
            print(f"hivejet: {msg}", file=sys.stderr)
        else:
            print(f"hivejet: {plan.message}\nhivejet: run `hivejet-gpu-setup` to install it.", file=sys.stderr)
    elif plan.cpu_mode:
        print(f"hivejet: {plan.message}", file=sys.stderr)
    if gui:
        from app.gui import run_gui
        return run_gui(a.model, smoke=a.smoke)
    from app.cli import main as cli_main
    print("hivejet: no display: opening the chat in the terminal", file=sys.stderr)
    return cli_main(["chat"] + (["-m", a.model] if a.model else []))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hivejet-gpu-setup", description="HiveJet's GPU setup (PyTorch build for "
                                "this machine's NVIDIA driver, or CPU mode).")
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("plan", help="print what the setup would do (JSON)")
    s = sub.add_parser("setup", help="download and install the PyTorch build that fits (the default)")
    s.add_argument("--yes", "-y", action="store_true", help="do not ask")
    s.add_argument("--flavor", default="auto", help="auto (default), cpu, or a CUDA build tag such as cu128")
    s.add_argument("--cache", default=None, help="download folder (default: <env>/gpu-cache/<flavor>)")
    s.add_argument("--pip-arg", action="append", default=[], help="extra pip argument (repeatable)")
    s.add_argument("--progress", choices=("terminal", "raw"), default="terminal",
                   help="terminal: pip draws its bars here (default); raw: line-by-line for the progress window")
    sub.add_parser("launch", help="first-run check, then the desktop app ([-m MODEL] [--smoke])")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return launch(argv[1:])
    a = p.parse_args(argv)
    if a.cmd == "plan":
        print(current_plan().to_json())
        return 0
    flavor = getattr(a, "flavor", "auto")
    plan = current_plan()
    if flavor != "auto":
        if flavor != "cpu" and not _tag_cuda(flavor):
            p.error(f"unknown flavor {flavor!r}: auto, cpu or cuNNN")
        plan = Plan("install", flavor, plan.gpu, f"Installing the {flavor} build of PyTorch.")
    print(plan.message, flush=True)
    if plan.action == "none":
        print("@@result ok nothing to do: " + plan.message, flush=True)
        return 0
    if not getattr(a, "yes", False) and sys.stdin.isatty():
        if input(f"Download about {plan.download_mb} MB and install it? [Y/n] ").strip().lower() not in ("", "y",
                                                                                                          "yes"):
            return 1
    if not env_writable():
        print(f"hivejet-gpu-setup: {sys.prefix} is not writable: run it as root (sudo hivejet-gpu-setup)",
              file=sys.stderr)
        print("@@result fail the environment is not writable: run the setup as administrator", flush=True)
        return 1
    raw = getattr(a, "progress", "terminal") == "raw"
    res = run_setup(plan, cache=Path(a.cache) if getattr(a, "cache", None) else None,
                    pip_args=getattr(a, "pip_arg", []), on_line=lambda s: print(s, flush=True),
                    runner=subprocess_runner if raw else terminal_runner, check_runner=subprocess_runner,
                    raw_progress=None if raw else False)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
