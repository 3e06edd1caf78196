"""Agent tasks (small Python exercises, each a folder with a TASK.md, a module and a failing test) and the
workspace an agent solves one in: a temporary folder that its tools (read_file, write_file, list_files,
run_tests) cannot leave.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TASKS_DIR = Path(__file__).resolve().parents[2] / "resources" / "agent_tasks"   # a source checkout
if not DEFAULT_TASKS_DIR.is_dir():  # an installed wheel: pyproject's data-files put resources in <prefix>/share
    DEFAULT_TASKS_DIR = Path(sys.prefix) / "share" / "hivejet" / "resources" / "agent_tasks"

MAX_FILE_BYTES = 64 * 1024       # write_file refuses more; read_file shows at most this much
MAX_TOOL_OUTPUT = 2000           # characters of a tool's answer that go back into the conversation
MAX_FILES = 50                   # files a workspace may hold


@dataclass
class Task:
    name: str
    path: Path
    description: str             # TASK.md

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith("."))


class TaskError(Exception):
    pass


def load_tasks(folder: str | os.PathLike | None = None) -> list[Task]:
    """The tasks in `folder` (default: resources/agent_tasks): every sub-folder with a TASK.md, by name."""
    root = Path(folder) if folder else DEFAULT_TASKS_DIR
    if not root.is_dir():
        raise TaskError(f"task folder not found: {root}")
    tasks = []
    for d in sorted(root.iterdir()):
        md = d / "TASK.md"
        if d.is_dir() and md.is_file():
            tasks.append(Task(d.name, d, md.read_text(encoding="utf-8", errors="replace").strip()))
    if not tasks:
        raise TaskError(f"no tasks in {root} (each task is a folder with a TASK.md, its code and a test_*.py)")
    return tasks


class ToolError(Exception):
    """A tool call that cannot be done (bad path, missing file): its message goes back to the model."""


@dataclass
class TestResult:
    passed: bool
    output: str
    seconds: float
    timed_out: bool = False


# The runner used when pytest is not installed: imports every test_*.py and calls its test_* functions.
_MINI_RUNNER = r"""
import importlib.util, pathlib, sys, traceback
sys.path.insert(0, ".")
failed = passed = 0
for f in sorted(pathlib.Path(".").glob("test_*.py")):
    try:
        spec = importlib.util.spec_from_file_location(f.stem, f)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except BaseException:
        failed += 1
        print(f"ERROR collecting {f.name}"); traceback.print_exc(limit=3, file=sys.stdout)
        continue
    for name in sorted(n for n in dir(mod) if n.startswith("test_") and callable(getattr(mod, n))):
        try:
            getattr(mod, name)()
            passed += 1
        except BaseException:
            failed += 1
            print(f"FAILED {f.name}::{name}"); traceback.print_exc(limit=3, file=sys.stdout)
print(f"{failed} failed, {passed} passed" if failed else f"{passed} passed")
sys.exit(1 if failed or not passed else 0)
"""


class Workspace:
    """A temporary copy of a task. Paths given to the tools are relative to it; absolute paths, '..' and
    links that lead outside are refused. close() removes it."""

    def __init__(self, task: Task, prefix: str = "hivejet-agent-", test_timeout: float = 60.0,
                 runner: str = "pytest"):
        self.task = task
        self.test_timeout = test_timeout
        self.runner = runner
        self.root = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
        for f in task.files():
            shutil.copy2(f, self.root / f.name)

    # ----- paths
    def resolve(self, path: str) -> Path:
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path must be a non-empty string relative to the task folder")
        p = path.strip().replace("\\", "/")
        if p.startswith("/") or p.startswith("~") or (len(p) > 1 and p[1] == ":"):
            raise ToolError(f"{path!r}: absolute paths are not allowed; use a path relative to the task folder")
        parts = [x for x in p.split("/") if x not in ("", ".")]
        if not parts or ".." in parts:
            raise ToolError(f"{path!r}: '..' is not allowed; stay inside the task folder")
        full = self.root.joinpath(*parts)
        try:
            full.resolve().relative_to(self.root)
        except ValueError:
            raise ToolError(f"{path!r} leads outside the task folder") from None
        return full

    # ----- the tools
    def list_files(self) -> str:
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root)
            if p.is_file() and not any(x.startswith(".") or x == "__pycache__" for x in rel.parts):
                out.append(f"{rel.as_posix()} ({p.stat().st_size} bytes)")
        return "\n".join(out) or "(no files)"

    def read_file(self, path: str) -> str:
        p = self.resolve(path)
        if not p.is_file():
            raise ToolError(f"{path!r}: no such file (list_files shows the files)")
        data = p.read_bytes()[:MAX_FILE_BYTES]
        return data.decode("utf-8", errors="replace")

    def write_file(self, path: str, content: str) -> str:
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        data = content.encode("utf-8")
        if len(data) > MAX_FILE_BYTES:
            raise ToolError(f"content is {len(data)} bytes; the limit is {MAX_FILE_BYTES}")
        p = self.resolve(path)
        if not p.exists() and sum(1 for x in self.root.rglob("*") if x.is_file()) >= MAX_FILES:
            raise ToolError(f"the task folder already holds {MAX_FILES} files")
        if p.is_dir():
            raise ToolError(f"{path!r} is a folder")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return f"wrote {len(data)} bytes to {p.relative_to(self.root).as_posix()}"

    def run_tests(self) -> TestResult:
        """`python -m pytest -q` in the folder (the small built-in runner when pytest is missing or
        runner="builtin")."""
        if self.runner == "pytest" and importlib.util.find_spec("pytest") is not None:
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "--tb=short", "-p", "no:cacheprovider",
                   "--no-header", "-o", "addopts=", "--rootdir", str(self.root)]
        else:
            cmd = [sys.executable, "-c", _MINI_RUNNER]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(self.root))
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=self.test_timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode("utf-8", errors="replace")
            return TestResult(False, out + f"\ntests timed out after {self.test_timeout:g} s", time.monotonic() - t0,
                              timed_out=True)
        out = r.stdout.decode("utf-8", errors="replace")
        return TestResult(r.returncode == 0, out, time.monotonic() - t0)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def clip(text: str, limit: int = MAX_TOOL_OUTPUT) -> str:
    """Keep a tool answer short: its head and tail around a marker."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return text[:head] + f"\n... ({len(text) - limit} characters left out) ...\n" + text[-tail:]
