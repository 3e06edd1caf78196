"""Check that every pinned stack of app/gpu_stack.json resolves: each torch and Triton version has a wheel for
its platform and for each Python the installers use there, so a missing version fails CI, not a user.

    .venv/bin/python installer/common/check_gpu_stack.py        # prints one line per check; exit 1 on a miss

What is checked, without downloading any wheel (the CUDA wheels are GBs):
* PyPI (its JSON simple API, PEP 691): the torch version exists for the platform and Python (PyTorch publishes
  every release there as well as on its own index; PyPI's Windows wheel is the CPU build, Linux's a CUDA
  build), and the Triton pin (triton-windows on Windows, triton on Linux) has a wheel for the platform and
  Python - the same file pip would pick with `pip download --only-binary=:all: --platform ... --python-version`.
* The CUDA (or CPU) wheel index of the row (download.pytorch.org, PEP 503 HTML): the exact file
  torch-<version>+<tag>-cpXY-cpXY-<platform>.whl. Where that index cannot be reached, the check says
  `unreachable` and does not fail: this part is then checked only where it can be reached.

Standard library only."""
from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from app import gpu_stack  # noqa: E402

PYPI = "https://pypi.org/simple"
PLATFORM_TAG = {"win32": re.compile(r"win_amd64"), "linux": re.compile(r"manylinux\w*_x86_64")}
TIMEOUT = 30


class Unreachable(RuntimeError):
    pass


@dataclass
class Check:
    what: str
    status: str          # "ok", "missing", "unreachable"
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.status:11s} {self.what}" + (f"  ({self.detail})" if self.detail else "")


def _get(url: str, accept: str) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "hivejet-stack-check"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return b""
        raise Unreachable(f"{url}: HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        raise Unreachable(f"{url}: {getattr(e, 'reason', e)}") from e


_cache: dict[str, list[str]] = {}


def pypi_files(project: str) -> list[str]:
    if project not in _cache:
        body = _get(f"{PYPI}/{project}/", "application/vnd.pypi.simple.v1+json")
        _cache[project] = [f["filename"] for f in json.loads(body)["files"]] if body else []
    return _cache[project]


def index_files(index: str, project: str) -> list[str]:
    key = f"{index}|{project}"
    if key not in _cache:
        body = _get(f"{index.rstrip('/')}/{project}/", "text/html").decode("utf-8", "replace")
        _cache[key] = [urllib.parse.unquote(m) for m in re.findall(r">\s*([^<>\s]+\.whl)\s*<", body)]
    return _cache[key]


def has_wheel(files: list[str], dist: str, version: str, py: str, platform: str) -> str:
    """The matching wheel's file name, '' when there is none."""
    tag = "cp" + py.replace(".", "")
    prefix = f"{dist.replace('-', '_')}-{version}-{tag}-{tag}-"
    for f in files:
        if f.lower().startswith(prefix.lower()) and PLATFORM_TAG[platform].search(f):
            return f
    return ""


def _check(what: str, files_of, dist: str, version: str, py: str, platform: str) -> Check:
    try:
        found = has_wheel(files_of(), dist, version, py, platform)
    except Unreachable as e:
        return Check(what, "unreachable", str(e))
    return Check(what, "ok", found) if found else Check(what, "missing", "no such wheel")


def checks(table: dict | None = None) -> list[Check]:
    table = table or gpu_stack.load()
    out: list[Check] = []
    for platform in ("win32", "linux"):
        for py in gpu_stack.pythons(platform, table):
            for s in gpu_stack.gpu_stacks(platform, table):
                row = f"{platform} py{py} {s.flavor} ({s.generation})"
                out.append(_check(f"{row}: torch {s.torch} on PyPI", lambda: pypi_files("torch"), "torch",
                                  s.torch, py, platform))
                out.append(_check(f"{row}: {s.triton} {s.triton_version} on PyPI",
                                  lambda s=s: pypi_files(s.triton), s.triton, s.triton_version, py, platform))
                out.append(_check(f"{row}: torch {s.torch}+{s.flavor} on {s.index}",
                                  lambda s=s: index_files(s.index, "torch"), "torch", f"{s.torch}+{s.flavor}",
                                  py, platform))
            c = gpu_stack.cpu_stack(platform, table)
            row = f"{platform} py{py} cpu"
            out.append(_check(f"{row}: torch {c.torch} on PyPI", lambda: pypi_files("torch"), "torch", c.torch,
                              py, platform))
            if c.local:
                out.append(_check(f"{row}: torch {c.torch}+{c.local} on {c.index}",
                                  lambda c=c: index_files(c.index, "torch"), "torch", f"{c.torch}+{c.local}",
                                  py, platform))
    return out


def main() -> int:
    results = checks()
    for c in results:
        print(c)
    missing = [c for c in results if c.status == "missing"]
    pypi_down = [c for c in results if c.status == "unreachable" and "on PyPI" in c.what]
    print(f"{sum(c.status == 'ok' for c in results)} ok, {len(missing)} missing, "
          f"{sum(c.status == 'unreachable' for c in results)} unreachable")
    return 1 if missing or pypi_down else 0


if __name__ == "__main__":
    sys.exit(main())
