"""The offline .deb on a clean Debian 12 root, the way a new user meets it: build it
(`build_deb.sh --offline`, the CPU torch wheel from a local wheelhouse), make a minimal Debian root with
debootstrap (Debian's mirror), install the package there with dpkg inside a network namespace that has no
network at all, run `hivejet generate -m demo -p hi -n 8` (the demo model carried in from this machine's model
folder, as a user would have copied it; also without network), purge the package, and check that nothing but
the user's data is left.

Needs root (chroot, debootstrap, unshare); skips cleanly otherwise. .ci/run installs debootstrap; under CI=true
a missing debootstrap fails. About 4-6 minutes on a 2-core machine (see docs/INSTALL.md for the measured time)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.installer.test_installers import LINUX, run

SUITE, MIRROR, PYVER = "bookworm", "http://deb.debian.org/debian", "3.11"   # Debian 12 and its python3
# What dpkg and apt keep about a package (their own bookkeeping), and the user's data: allowed after a purge.
BOOKKEEPING = ("var/lib/dpkg/", "var/log/", "var/cache/", "var/lib/apt/", "var/cache/debconf/", "var/cache/ldconfig/")
USER_DATA = ("root/.local/share/hivejet/",)


def need_root_tools() -> None:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("needs root (debootstrap, chroot, unshare)")
    for tool in ("debootstrap", "dpkg-deb", "unshare", "chroot"):
        if not shutil.which(tool):
            if os.environ.get("CI") == "true":
                pytest.fail(f"{tool} is missing: .ci/run should have installed it")
            pytest.skip(f"{tool} is not installed")


def files_under(root: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.split(os.sep)[0] in ("proc", "sys", "dev", "tmp", "run"):
            dirnames[:] = []
            continue
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(os.path.normpath(os.path.join(rel, name)))
    return out


def in_root(root: Path, cmd: str, timeout: int = 600, network: bool = False) -> subprocess.CompletedProcess:
    """cmd in the Debian root (its own /proc, mounted in a private mount namespace that goes with the command);
    without network unless asked: `unshare -n` gives the command a network namespace with no interface up."""
    script = f"mount -t proc proc {root}/proc && exec chroot {root} /usr/bin/env -i HOME=/root " \
             f"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 sh -c '{cmd}'"
    return run(["unshare", "-m"] + ([] if network else ["-n"]) + ["sh", "-c", script], timeout=timeout, check=False)


@pytest.fixture(scope="module")
def demo_model() -> Path:
    need_root_tools()              # skip before fetching anything
    from engine.catalog import ensure_model
    return ensure_model("demo", progress=lambda s: None)


def test_offline_deb_on_clean_debian(tmp_path, demo_model):
    need_root_tools()
    t0 = time.monotonic()
    times = {}
    # The clean Debian root (Debian's mirror) is made while the .deb is built: both take 1-3 minutes.
    control_in = (LINUX / "debian" / "control.in").read_text()
    depends = control_in.split("Depends:", 1)[1].splitlines()[0]
    pkgs = sorted({d.split()[0] for d in depends.split(",") if d.strip() and "@" not in d})
    root = tmp_path / "debian"
    bootstrap = subprocess.Popen(["debootstrap", "--variant=minbase", f"--include=python3,{','.join(pkgs)}", SUITE,
                                  str(root), MIRROR], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bootstrap_end: list[float | None] = [None]
    log: list[str] = []

    def drain():              # reads its output (a full pipe would stop it) and notes when it ended
        log.extend(bootstrap.stdout)
        bootstrap.wait()
        bootstrap_end[0] = time.monotonic()
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    # the offline .deb for Debian 12's Python, the CPU torch wheel from a local wheelhouse
    wheelhouse = tmp_path / "wheelhouse"
    from app import gpu_stack
    try:
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--platform",
             "manylinux_2_28_x86_64", "--python-version", PYVER, "-d", wheelhouse,
             gpu_stack.cpu_stack("linux").torch_spec], timeout=600)
        p = run(["sh", LINUX / "build_deb.sh", "--offline", "--python-version", PYVER, "--find-links", wheelhouse,
                 "--out", tmp_path / "dist"], env=dict(os.environ, PYTHON=sys.executable), timeout=900)
    except BaseException:
        bootstrap.kill()
        reader.join(timeout=60)
        raise
    deb = Path(p.stdout.strip().splitlines()[-1])
    installed_kb = int(run(["dpkg-deb", "-f", deb, "Installed-Size"]).stdout.split()[0])
    times["build"] = time.monotonic() - t0
    reader.join(timeout=900)
    assert bootstrap.returncode == 0, "".join(log)[-4000:]
    times["debootstrap (beside the build)"] = float(bootstrap_end[0] or time.monotonic()) - t0
    try:
        shutil.copy(deb, root / "tmp" / deb.name)
        models = root / "root" / ".local" / "share" / "hivejet" / "models"
        models.mkdir(parents=True)
        shutil.copy(demo_model, models / demo_model.name)
        before = files_under(root)

        # 3. install with no network at all
        t = time.monotonic()
        p = in_root(root, f"dpkg -i /tmp/{deb.name}")
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        times["install"] = time.monotonic() - t
        assert "not complete" not in p.stderr, p.stderr[-3000:]
        status = in_root(root, "dpkg-query -W -f=\\${Status} hivejet").stdout
        assert status == "install ok installed", status
        assert not (root / "opt" / "hivejet" / "venv" / "hivejet-incomplete").exists()
        used_kb = int(run(["du", "-sk", root / "opt" / "hivejet"]).stdout.split()[0])
        assert 0.7 * used_kb <= installed_kb <= 1.3 * used_kb, (installed_kb, used_kb)   # an honest Installed-Size

        # 4. run it, offline
        t = time.monotonic()
        p = in_root(root, "hivejet generate -m demo -p hi -n 8", timeout=300)
        assert p.returncode == 0 and p.stdout.strip(), p.stdout[-3000:] + p.stderr[-3000:]
        times["generate"] = time.monotonic() - t

        # 5. purge: nothing but the user's data (and dpkg's own records) is left
        p = in_root(root, "dpkg --purge hivejet")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert not (root / "opt" / "hivejet").exists() and not (root / "usr" / "bin" / "hivejet").exists()
        left = sorted(f for f in files_under(root) - before if not f.startswith(BOOKKEEPING + USER_DATA))
        assert left == [], left
        assert (models / demo_model.name).exists()                      # the user's data stays
        gone = sorted(f for f in before - files_under(root) if not f.startswith(BOOKKEEPING))
        assert gone == [], gone
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times["total"] = time.monotonic() - t0
    print(f"deb {deb.stat().st_size / 1e6:.0f} MB, Installed-Size {installed_kb / 1024:.0f} MiB, /opt/hivejet "
          f"{used_kb / 1024:.0f} MiB; " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
