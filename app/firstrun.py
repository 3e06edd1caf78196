"""First-run GPU setup of an installed HiveJet (the Windows installer and the Linux .deb).

The installers put HiveJet into a private Python environment (`sys.prefix`: %LOCALAPPDATA%\\Programs\\HiveJet\\python
on Windows, /opt/hivejet/venv on Linux). PyTorch comes in one of several builds, and which one fits depends on
the machine: a CUDA build matching the NVIDIA driver, or the CPU build. This module picks and installs it:

* `probe_gpus()` asks `nvidia-smi` for each GPU's name, driver, the CUDA version the driver supports and its
  compute capability ([] plus a reason when there is no NVIDIA driver).
* `installed_torch()` reads which torch build the environment holds, without importing torch (so that it can
  still be replaced: Windows locks the DLLs of a loaded torch).
* `choose()` turns those two into a Plan: nothing to do, or install one of the pinned stacks of
  app/gpu_stack.json (torch version, CUDA wheel index, triton-windows version; `app/gpu_stack.py`) or the
  pinned CPU build, with the message the user sees (CPU mode and why, when there is no suitable GPU).
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from app import gpu_stack

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
    torch_spec: str = ""          # the pinned torch, e.g. "torch==2.11.0+cu128" ("": the flavor's pinned one)
    index: str = ""               # the wheel index it comes from
    triton_spec: str = ""         # Windows: the pinned triton-windows, e.g. "triton-windows==3.6.0.post26"

    def pinned(self, platform: str = sys.platform) -> "Plan":
        """This plan with its pins filled in from app/gpu_stack.json (a plan made from a flavor alone)."""
        if self.torch_spec:
            return self
        if self.flavor == "cpu":
            c = gpu_stack.cpu_stack(platform)
            return replace(self, torch_spec=c.torch_spec, index=c.index)
        st = gpu_stack.for_flavor(self.flavor, self.gpu.compute if self.gpu else None, platform)
        if st is None:
            raise ValueError(f"no pinned {self.flavor} stack for this platform and GPU (see app/gpu_stack.json)")
        return replace(self, torch_spec=st.torch_spec, index=st.index,
                       triton_spec=st.triton_spec if platform == "win32" else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def suitable(gpu: GpuProbe, platform: str = sys.platform) -> str:
    """'' when one of the pinned GPU stacks runs on `gpu`, else why not."""
    low = gpu_stack.min_compute(platform)
    if gpu.compute is not None and gpu.compute < low:
        return (f"the {gpu.name} (compute capability {gpu.compute[0]}.{gpu.compute[1]}) is older than what "
                f"HiveJet's GPU kernels need ({low[0]}.{low[1]}: GeForce RTX 20 / Turing or newer)")
    if gpu_stack.pick(gpu.compute, gpu.cuda, platform):
        return ""
    rows = [s for s in gpu_stack.gpu_stacks(platform) if s.fits(gpu.compute, (99, 0))]
    if not rows:
        return (f"the {gpu.name} (compute capability {gpu.compute[0]}.{gpu.compute[1]}) is not supported by "
                "HiveJet's pinned Triton on this system" if gpu.compute else f"the {gpu.name} is not supported")
    need = min(s.min_cuda for s in rows)
    have = f"CUDA {gpu.cuda[0]}.{gpu.cuda[1]}" if gpu.cuda else "an unknown CUDA version"
    return (f"NVIDIA driver {gpu.driver} supports {have}; HiveJet's GPU build needs CUDA "
            f"{need[0]}.{need[1]} or newer. Update the driver (nvidia.com/drivers) and start HiveJet "
            "again to use the GPU")


def choose(gpus: list[GpuProbe], reason: str, torch: TorchBuild, platform: str = sys.platform) -> Plan:
    """What to install, given the GPUs and the torch build in the environment."""
    good = [g for g in gpus if not suitable(g, platform)]
    if not good:
        why = suitable(max(gpus, key=lambda g: g.memory_mib), platform) if gpus else reason or "no NVIDIA GPU found"
        msg = f"No suitable NVIDIA GPU: HiveJet runs in CPU mode ({why}). Small models run well on the CPU."
        if torch.version:      # any build runs on the CPU, a CUDA one too
            return Plan("none", torch.flavor or "cpu", None, msg, cpu_mode=True)
        return Plan("install", "cpu", None, msg + " Installing the CPU build of PyTorch.", cpu_mode=True,
                    download_mb=SIZES_MB["cpu"]).pinned(platform)
    gpu = max(good, key=lambda g: g.memory_mib)
    stack = gpu_stack.pick(gpu.compute, gpu.cuda, platform)
    assert stack is not None     # suitable() said so
    want = stack.flavor
    pins = dict(torch_spec=stack.torch_spec, index=stack.index,
                triton_spec=stack.triton_spec if platform == "win32" else "")
    if torch.is_cuda:
        have = _tag_cuda(torch.flavor)
        # A stack bounded above (Windows Turing: Triton <= 3.2) needs exactly its torch; else any CUDA build the
        # driver runs is kept (an untagged PyPI one too).
        same = stack.max_compute is None or (torch.version or "").partition("+")[0] == stack.torch
        if (have is None or have <= gpu.cuda) and same:
            return Plan("none", torch.flavor, gpu, f"GPU mode: {gpu.name} (torch {torch.version}).")
        why = (f"needs a newer driver than {gpu.driver}" if same else
               f"comes with a Triton that does not support the {gpu.name}")
        msg = f"The installed PyTorch ({torch.version}) {why}: installing {stack.torch_spec} ({want} build)."
    elif torch.version:
        msg = (f"Found {gpu.name} ({gpu.memory_mib // 1024} GiB, driver {gpu.driver}). GPU support needs the "
               f"CUDA build of PyTorch ({want}, about {SIZES_MB['cuda'] / 1000:.1f} GB to download once); until "
               "then HiveJet runs in CPU mode.")
    else:
        msg = f"Found {gpu.name}: installing the CUDA build of PyTorch ({want})."
    return Plan("install", want, gpu, msg, download_mb=SIZES_MB["cuda"], **pins)


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


def pip_version(python: str, capture=_run_capture) -> tuple[int, int]:
    """The environment's pip version ((0, 0) when pip does not run)."""
    rc, out = capture([python, "-m", "pip", "--version"])
    m = re.search(r"pip (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if rc == 0 and m else (0, 0)


def pip_supports_raw_progress(python: str, capture=_run_capture) -> bool:
    return pip_version(python, capture) >= (24, 1)


RESUME_RETRIES = 20       # pip >= 25.1: a dropped connection resumes the wheel where it stopped
TAIL_LINES = 12           # how much of a failing step's own output its message quotes


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


def _tail(lines: list[str], n: int = TAIL_LINES) -> str:
    """The last meaningful lines of a step's output (pip's or pkexec's error), for the message the user sees."""
    keep = [ln for ln in lines if ln.strip() and not ln.startswith(("@@", "Progress "))]
    return "\n".join(keep[-n:])


def run_setup(plan: Plan, *, python: str = sys.executable, cache: Path | None = None, runner: Runner = subprocess_runner,
              on_line: Callable[[str], None] = print, pip_args: Sequence[str] = (), platform: str = sys.platform,
              raw_progress: bool | None = None, check_runner: Runner | None = None,
              resume: bool | None = None) -> SetupResult:
    """Download and install the pinned torch build of `plan` into `python`'s environment. Steps are announced as
    `@@step K N title` lines, pip's progress as `Progress X of Y` (pip >= 24.1), the end as `@@result ok|fail`;
    a failure's message ends with the failing step's own output. `runner` runs the pip steps, `check_runner`
    (default: `runner`) the final import check, whose output it reads. The download folder is kept until the
    install succeeded, so a retry skips the wheels already there; pip >= 25.1 also resumes a wheel cut off
    mid-download (`resume`, default: when the environment's pip has it)."""
    check_runner = check_runner or runner
    plan = plan.pinned(platform)
    cuda = plan.flavor != "cpu"
    # Default download folder: next to the environment, so that a Windows upgrade (which replaces the
    # environment) installs the GPU build again without downloading it again. Linux keeps its venv across
    # upgrades and drops the download once installed.
    keep = cache is not None or platform == "win32"
    cache = Path(cache) if cache else _env_prefix(python).parent / "gpu-cache" / plan.flavor
    cache.mkdir(parents=True, exist_ok=True)
    dl_opts = _download_options(python, raw_progress, resume)
    pip = [python, "-m", "pip"]
    total = 4 if plan.triton_spec else 3
    out = _SetupLog(on_line, total)
    what = f"PyTorch ({plan.torch_spec.partition('==')[2]}" + (", CUDA" if cuda else "") + ")"

    out.step(1, f"Downloading {what}")
    rc = runner(pip + ["download", "--only-binary=:all:", "--dest", str(cache), "--index-url", plan.index, plan.torch_spec, *dl_opts, *pip_args], out.say)
    tv = wheel_version(cache, "torch")
    if rc != 0 or not tv:
        return out.done(False, False, f"Downloading {what} from {plan.index} failed (exit {rc}); nothing was changed. "
                        "Check the internet connection and try again; what was downloaded is kept. HiveJet runs in "
                        "CPU mode until then.", quote=True)
    extra: list[str] = []
    if plan.triton_spec:
        out.step(2, "Downloading Triton for Windows")
        rc = runner(pip + ["download", "--only-binary=:all:", "--no-deps", "--dest", str(cache), plan.triton_spec,
                           *dl_opts, *pip_args], out.say)
        if rc != 0 or not wheel_version(cache, TRITON_WINDOWS):
            return out.done(False, False, f"Downloading {plan.triton_spec} failed (exit {rc}); nothing was changed. "
                            "HiveJet runs in CPU mode until the next try.", quote=True)
        extra = [plan.triton_spec]
    out.step(total - 1, f"Installing {what}")
    rc = runner(pip + ["install", "--no-index", "--find-links", str(cache), "--upgrade", f"torch=={tv}", *extra,
                       "--no-warn-script-location", *pip_args], out.say)
    if rc != 0:
        return out.done(False, False, f"Installing {what} failed (exit {rc}). Run the setup again "
                        "(see docs/INSTALL.md); HiveJet may not start until it succeeds.", tv, quote=True)
    out.step(total, "Checking PyTorch")
    result = _check_torch(plan, python, tv, check_runner, out)
    if result is not None:
        return result
    if not keep:
        shutil.rmtree(cache, ignore_errors=True)
    _write_state(python, {"flavor": plan.flavor, "torch": tv, "gpu": plan.gpu.name if plan.gpu else None,
                          "driver": plan.gpu.driver if plan.gpu else None, "time": time.time()})
    if cuda:
        return out.done(True, True, f"GPU support is ready: PyTorch {tv} on {plan.gpu.name if plan.gpu else 'the GPU'}.",
                        tv)
    return out.done(True, False, f"PyTorch {tv} (CPU build) is installed: HiveJet runs in CPU mode.", tv)


class _SetupLog:
    """run_setup's output: every line goes to on_line and the full log; the current step's own lines are
    kept for quoting in a failure's message."""

    def __init__(self, on_line: Callable[[str], None], total: int):
        self.on_line, self.total = on_line, total
        self.log: list[str] = []
        self.step_out: list[str] = []

    def say(self, line: str) -> None:
        self.log.append(line)
        self.step_out.append(line)
        self.on_line(line)

    def step(self, k: int, title: str) -> None:
        self.step_out.clear()
        self.say(f"@@step {k} {self.total} {title}")

    def done(self, ok: bool, gpu_ready: bool, msg: str, tv: str = "", quote: bool = False) -> SetupResult:
        if quote and _tail(self.step_out):
            msg += "\n\n" + _tail(self.step_out)
        self.say(f"@@result {'ok' if ok else 'fail'} {msg}".replace("\n", "\\n"))
        return SetupResult(ok, gpu_ready, msg, tv, self.log)


def _download_options(python: str, raw_progress: bool | None, resume: bool | None) -> list[str]:
    """pip download's progress and resume options, by default as far as the environment's pip has them."""
    if raw_progress is None or resume is None:
        pv = pip_version(python)
        raw_progress = pv >= (24, 1) if raw_progress is None else raw_progress
        resume = pv >= (25, 1) if resume is None else resume
    return (["--progress-bar", "raw"] if raw_progress else []) + (
        ["--resume-retries", str(RESUME_RETRIES)] if resume else [])


def _check_torch(plan: Plan, python: str, tv: str, check_runner: Runner, out: _SetupLog) -> SetupResult | None:
    """Import the installed torch in `python`: the failed result when it does not import (or, for a CUDA
    build, does not see the GPU), else None."""
    said: list[str] = []
    rc = check_runner([python, "-c", "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"],
                      lambda s: (said.append(s), out.say(s)))
    text = " ".join(said)
    if rc != 0:
        return out.done(False, False, f"PyTorch {tv} does not import: {text[-300:]}", tv)
    if plan.flavor != "cpu" and "cuda True" not in text:
        return out.done(True, False, f"PyTorch {tv} is installed but does not see the GPU ({text[-200:]}): "
                        "HiveJet runs in CPU mode. A reboot after a driver update often fixes this.", tv)
    return None


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
    its log; `dialog.result_ok`/`dialog.result_message` hold the outcome once it closes. Needs a QApplication
    (app/gui/setup_progress.py; imported here so that this module loads without Qt)."""
    from app.gui.setup_progress import SetupProgressDialog
    return SetupProgressDialog(command, title, stopped=stopped_message, tail_lines=TAIL_LINES)


def stopped_message(command: Sequence[str], code: int, recent: Sequence[str]) -> str:
    """What the dialog says when the setup process ended without its own result line: pkexec refused or
    failed, or the setup crashed. Quotes the process's last output lines (pkexec's or Python's error)."""
    elevated = bool(command) and Path(command[0]).name == "pkexec"
    if elevated and code == 126:
        head = "The administrator password was not given (pkexec: authorization refused or cancelled)."
    elif elevated and code == 127:
        head = ("pkexec could not ask for the administrator password (no polkit authentication agent is running?). "
                "Run `sudo hivejet-gpu-setup` in a terminal instead.")
    else:
        head = f"The setup stopped (exit code {code})."
    tail = "\n".join(ln for ln in recent if ln.strip())
    return head + (f"\n\n{tail}" if tail else "")


def show_failure(message: str) -> bool:
    """The failed setup's message (with the failing step's own output) and a Retry button; True: retry."""
    from PySide6.QtWidgets import QMessageBox
    box = QMessageBox()
    box.setWindowTitle("HiveJet - GPU setup")
    box.setIcon(QMessageBox.Warning)
    head, _, detail = message.partition("\n\n")
    box.setText(head + "\n\nHiveJet runs in CPU mode until the setup succeeds.")
    if detail:
        box.setDetailedText(detail)
        box.setInformativeText(detail.splitlines()[-1][:300])
    retry = box.addButton("Retry", QMessageBox.AcceptRole)
    box.addButton("Close", QMessageBox.RejectRole)
    box.setDefaultButton(retry)
    box.exec()
    return box.clickedButton() is retry


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
    while True:
        dlg = make_progress_dialog(command)
        dlg.start()
        dlg.exec()
        if dlg.result_ok or not show_failure(dlg.result_message):
            return dlg.result_ok, dlg.result_message


# ----------------------------------------------------------------------------------------------- start check
VC_REDIST_URL = "https://aka.ms/vs/17/release/vc_redist.x64.exe"


def torch_import_error(importer: Callable[[str], object] = __import__, platform: str = sys.platform) -> str:
    """'' when torch imports, else what the user is told: the error itself and the fix. On Windows the usual
    cause is a missing Microsoft Visual C++ runtime DLL (MSVCP140.dll, VCRUNTIME140_1.dll, ...): the installer
    ships them in python\\ beside python.exe, so a missing one means a damaged install."""
    try:
        importer("torch")
        return ""
    except Exception as e:    # ImportError, OSError (WinError 126: a DLL or one of its dependencies), ...
        err = f"{type(e).__name__}: {e}"
    msg = f"PyTorch could not be loaded ({err})."
    if platform == "win32":
        msg += (" A DLL it needs is missing: most often the Microsoft Visual C++ runtime (MSVCP140.dll, "
                "VCRUNTIME140_1.dll, MSVCP140_ATOMIC_WAIT.dll, VCRUNTIME140_THREADS.dll), which HiveJet's installer "
                "puts in its python folder. Run the HiveJet installer again to repair it, or install Microsoft's "
                f"Visual C++ Redistributable ({VC_REDIST_URL}).")
    else:
        msg += " Repair HiveJet's environment: sudo /opt/hivejet/lib/setup-env.sh (or sudo hivejet-gpu-setup)."
    return msg


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
    err = torch_import_error()
    if err:
        print(f"hivejet: {err}", file=sys.stderr)
        if gui:
            from PySide6.QtWidgets import QApplication, QMessageBox
            _app = QApplication.instance() or QApplication(sys.argv[:1])
            QMessageBox.critical(None, "HiveJet cannot start", err)
        return 1
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
    s.add_argument("--if-missing", action="store_true",
                   help="only when the environment has no torch at all (the .deb's postinst: a reinstall or an "
                        "upgrade never replaces the build the user has)")
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
    have = installed_torch()
    if getattr(a, "if_missing", False) and have.version:
        print(f"@@result ok nothing to do: PyTorch {have.version} ({have.flavor} build) is installed", flush=True)
        return 0
    plan = current_plan()
    if flavor not in ("auto", plan.flavor if plan.action == "install" else "auto"):
        if flavor != "cpu" and not _tag_cuda(flavor):
            p.error(f"unknown flavor {flavor!r}: auto, cpu or cuNNN")
        try:
            plan = Plan("install", flavor, plan.gpu, f"Installing the {flavor} build of PyTorch.").pinned()
        except ValueError as e:
            print(f"hivejet-gpu-setup: {e}", file=sys.stderr)
            print(f"@@result fail {e}", flush=True)
            return 2
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
