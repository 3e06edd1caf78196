"""The installers, built and checked the way CI can: the .deb is built from the checkout, unpacked into a
throwaway root, its postinst builds the private venv there (offline: the venv sees this test environment's
site-packages through a .pth file, so torch and Qt are not downloaded again, and pip runs with --no-index),
the installed copy runs `hivejet --version`, the offscreen smoke test and the first-run launcher, an upgrade
in place runs postinst again, and prerm/postrm remove it. The NSIS script is compiled with a stub payload, and
the workflows go through actionlint.

A missing tool (dpkg-deb, makensis, actionlint) skips its test locally, but fails under CI=true: .ci/run
installs them (Debian's nsis; actionlint through the `test` extra)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINUX = REPO / "installer" / "linux"
WINDOWS = REPO / "installer" / "windows"


def need_tool(name: str) -> str:
    path = shutil.which(name) or (shutil.which(name, path=str(Path(sys.executable).parent)))
    if not path:
        msg = f"{name} is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{msg}: .ci/run should have installed it")
        pytest.skip(msg)
    return path


def run(argv, env=None, cwd=None, timeout=300, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n"
                             f"{p.stderr[-4000:]}")
    return p


# ------------------------------------------------------------------------------------------------ Linux .deb
@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    need_tool("dpkg-deb")
    if sys.platform != "linux":
        pytest.skip("the .deb is built on Linux")
    out = tmp_path_factory.mktemp("deb")
    p = run(["sh", LINUX / "build_deb.sh", "--out", out], env=dict(os.environ, PYTHON=sys.executable), timeout=600)
    path = Path(p.stdout.strip().splitlines()[-1])
    assert path.is_file() and path.name.startswith("hivejet_") and path.name.endswith("_all.deb")
    return path


def test_deb_metadata_and_contents(deb):
    from app import __version__
    info = run(["dpkg-deb", "--info", deb]).stdout
    fields = dict(line.strip().split(": ", 1) for line in info.splitlines()
                  if ": " in line and line.startswith(" ") and not line.startswith("  "))
    assert fields["Package"] == "hivejet" and fields["Version"] == __version__
    assert fields["Architecture"] == "all"
    assert "python3-venv" in fields["Depends"] and "libxcb-cursor0" in fields["Depends"]
    for script in ("postinst", "prerm", "postrm"):
        assert script in info
    listing = run(["dpkg-deb", "--contents", deb]).stdout
    files = {line.split()[-1].lstrip(".") for line in listing.splitlines()}
    for f in ("/usr/bin/hivejet", "/usr/bin/hivejet-gpu-setup", "/usr/share/applications/hivejet.desktop",
              "/usr/share/icons/hicolor/scalable/apps/hivejet.svg", "/usr/share/icons/hicolor/256x256/apps/hivejet.png",
              "/opt/hivejet/lib/setup-env.sh", "/opt/hivejet/bin/hivejet-launch",
              f"/opt/hivejet/wheels/hivejet-{__version__}-py3-none-any.whl", "/usr/share/doc/hivejet/copyright"):
        assert f in files, f"{f} missing from the .deb"
    for line in listing.splitlines():
        name = line.split()[-1]
        assert line.split()[1] == "root/root", line
        if line.startswith("-") and ("/bin/" in name or name.endswith("setup-env.sh")):
            assert line.startswith("-rwxr-xr-x"), line


def test_desktop_entry():
    text = (LINUX / "hivejet.desktop").read_text()
    entry = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert entry["Exec"] == "/opt/hivejet/bin/hivejet-launch" and entry["Icon"] == "hivejet"
    assert entry["Type"] == "Application" and entry["Terminal"] == "false"
    if shutil.which("desktop-file-validate"):
        run(["desktop-file-validate", LINUX / "hivejet.desktop"])


def test_deb_install_run_upgrade_uninstall(deb, tmp_path):
    root = tmp_path / "root"
    run(["dpkg-deb", "-x", deb, root])
    run(["dpkg-deb", "-e", deb, root / "DEBIAN"])
    prefix = root / "opt" / "hivejet"
    paths = sysconfig.get_paths()
    inherit = os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HIVEJET_PREFIX=str(prefix), HIVEJET_PYTHON=sys.executable, HIVEJET_PIP_ARGS="--no-index",
               HIVEJET_INHERIT_SITE=inherit, HIVEJET_NVIDIA_SMI="", QT_QPA_PLATFORM="offscreen",
               HIVEJET_HOME=str(tmp_path / "home"), HIVEJET_MODELS=str(tmp_path / "home" / "models"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    work = tmp_path / "cwd"            # not the checkout: nothing may import from it
    work.mkdir()

    p = run(["sh", root / "DEBIAN" / "postinst", "configure"], env=env, cwd=work)
    assert "nothing to do: PyTorch" in p.stdout and "hivejet " in p.stdout
    venv_py = prefix / "venv" / "bin" / "python"
    assert venv_py.exists()

    # the installed copy, not the checkout
    p = run([venv_py, "-c", "import app, app.gui.theme as t; print(app.__file__); print(t.RESOURCES)"], env=env, cwd=work)
    mod, res = p.stdout.split()
    assert mod.startswith(str(prefix / "venv")), mod
    assert res.startswith(str(prefix / "venv")) and (Path(res) / "qss" / "app.qss").is_file(), res

    from app import __version__
    p = run(["sh", root / "usr" / "bin" / "hivejet", "--version"], env=env, cwd=work)
    assert p.stdout.strip() == f"hivejet {__version__}"
    p = run([venv_py, "-m", "app.gui", "--smoke"], env=env, cwd=work, timeout=180)
    assert "smoke ok" in p.stdout
    p = run(["sh", prefix / "bin" / "hivejet-launch", "--smoke"], env=env, cwd=work, timeout=180)
    assert "smoke ok" in p.stdout and "CPU mode" in p.stderr
    p = run(["sh", root / "usr" / "bin" / "hivejet-gpu-setup", "plan"], env=env, cwd=work)
    assert '"cpu_mode": true' in p.stdout

    # upgrade in place: prerm upgrade keeps the venv, postinst updates it. A GPU appeared meanwhile (a fake
    # nvidia-smi): the upgrade still never downloads the CUDA build (the user may have chosen "Always use the
    # CPU"; the app asks at its start); pip runs with --no-index here, so any download would fail the test.
    marker = prefix / "venv" / "kept-across-upgrade"
    marker.write_text("")
    from tests.installer.test_firstrun import SMI_BANNER, SMI_QUERY, fake_smi
    gpu_env = dict(env, HIVEJET_NVIDIA_SMI=fake_smi(tmp_path, SMI_QUERY, SMI_BANNER))
    run(["sh", root / "DEBIAN" / "prerm", "upgrade", "0.0.1"], env=gpu_env, cwd=work)
    p = run(["sh", root / "DEBIAN" / "postinst", "configure", "0.0.1"], env=gpu_env, cwd=work)
    assert marker.exists() and "nothing to do" in p.stdout and "cu12" not in p.stdout + p.stderr
    assert not (prefix / "venv" / "hivejet-incomplete").exists()
    run(["sh", root / "usr" / "bin" / "hivejet", "--version"], env=env, cwd=work)

    # uninstall: prerm removes what postinst made, postrm purge the rest; dpkg removes its own files
    run(["sh", root / "DEBIAN" / "prerm", "remove"], env=env, cwd=work)
    assert not (prefix / "venv").exists()
    p = run(["sh", root / "usr" / "bin" / "hivejet", "--version"], env=env, cwd=work, check=False)
    assert p.returncode == 1 and "missing" in p.stderr
    run(["sh", root / "DEBIAN" / "postrm", "purge"], env=env, cwd=work)
    shutil.rmtree(root)


def test_postinst_without_network_leaves_apt_working(deb, tmp_path):
    """No torch and no network (pip --no-index, nothing inherited): postinst exits 0, the environment is marked
    incomplete, and `hivejet` says how to finish it instead of failing with an import error."""
    root = tmp_path / "root"
    run(["dpkg-deb", "-x", deb, root])
    run(["dpkg-deb", "-e", deb, root / "DEBIAN"])
    prefix = root / "opt" / "hivejet"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(HIVEJET_PREFIX=str(prefix), HIVEJET_PYTHON=sys.base_prefix + "/bin/python3", HIVEJET_NVIDIA_SMI="",
               HIVEJET_PIP_ARGS="--no-index", PIP_CONFIG_FILE=os.devnull, HOME=str(tmp_path))
    p = run(["sh", root / "DEBIAN" / "postinst", "configure"], env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0 and "not complete" in p.stderr and "setup-env.sh" in p.stderr
    assert "PyTorch download failed" in (prefix / "venv" / "hivejet-incomplete").read_text()
    p = run(["sh", root / "usr" / "bin" / "hivejet", "--version"], env=env, check=False)
    assert p.returncode == 1 and "not complete" in p.stderr and "PyTorch download failed" in p.stderr
    shutil.rmtree(root)


def test_setup_env_refuses_without_wheel(tmp_path):
    env = dict(os.environ, HIVEJET_PREFIX=str(tmp_path))
    p = run(["sh", LINUX / "setup-env.sh"], env=env, check=False)
    assert p.returncode == 1 and "no HiveJet wheel" in p.stderr


# ------------------------------------------------------------------------------------------------ Windows NSIS
VC_RUNTIME = ("msvcp140.dll", "msvcp140_atomic_wait.dll", "vcruntime140.dll", "vcruntime140_1.dll",
              "vcruntime140_threads.dll")


def stub_payload(root: Path, dlls=VC_RUNTIME) -> Path:
    payload = root / "payload"
    (payload / "python" / "Lib" / "site-packages" / "app").mkdir(parents=True)
    for f in ("python/python.exe", "python/pythonw.exe", "python/Lib/site-packages/app/__init__.py", "hivejet.cmd",
              "README.txt", *(f"python/{d}" for d in dlls)):
        (payload / f).write_text("stub")
    shutil.copy(REPO / "resources" / "icons" / "hivejet.ico", payload / "hivejet.ico")
    return payload


def makensis_run(makensis: str, payload: Path, exe: Path, check=True):
    return run([makensis, "-V2", "-WX", "-DVERSION=0.1.0", "-DVIVERSION=0.1.0.0", f"-DPAYLOAD={payload}",
                f"-DOUTFILE={exe}", WINDOWS / "hivejet.nsi"], check=check)


def test_nsis_script_compiles_with_stub_payload(tmp_path):
    makensis = need_tool("makensis")
    exe = tmp_path / "HiveJet-0.1.0-setup.exe"
    makensis_run(makensis, stub_payload(tmp_path), exe)
    assert exe.read_bytes()[:2] == b"MZ" and exe.stat().st_size > 50_000


def test_nsis_refuses_a_payload_without_the_vc_runtime(tmp_path):
    """torch and Triton load MSVCP140.dll & co.: an installer without them works only where Visual Studio or
    vc_redist happens to be installed (CI's Windows runner), so makensis stops."""
    makensis = need_tool("makensis")
    payload = stub_payload(tmp_path, dlls=[d for d in VC_RUNTIME if d != "msvcp140_atomic_wait.dll"])
    p = makensis_run(makensis, payload, tmp_path / "x.exe", check=False)
    assert p.returncode != 0 and "msvcp140_atomic_wait.dll is missing" in p.stdout + p.stderr


def test_nsis_script_promises():
    """What the issue asks of the Windows installer, as written in the script."""
    nsi = (WINDOWS / "hivejet.nsi").read_text()
    assert "RequestExecutionLevel user" in nsi                                  # no admin rights
    assert 'InstallDir "$LOCALAPPDATA\\Programs\\HiveJet"' in nsi
    assert 'CreateShortCut "$SMPROGRAMS\\HiveJet.lnk"' in nsi and 'CreateShortCut "$DESKTOP\\HiveJet.lnk"' in nsi
    assert "-m app.firstrun launch" in nsi                                      # first-run GPU setup
    assert 'ReadRegStr $0 HKCU "${UNINST_KEY}" "InstallLocation"' in nsi          # upgrade in place
    assert "MB_YESNO" in nsi and "/SD IDNO" in nsi and 'RMDir /r "${DATA_DIR}"' in nsi   # asks about user data
    assert 'RMDir /r "$INSTDIR"' not in nsi                                    # never a blind recursive delete
    # atomic upgrade: unpack beside, swap with renames, roll back; never RMDir /r the live python\
    assert 'File /r "${PAYLOAD}\\python\\*"' in nsi and 'SetOutPath "$INSTDIR\\python.new"' in nsi
    assert 'Rename "$INSTDIR\\python" "$INSTDIR\\python.old"' in nsi
    assert 'Rename "$INSTDIR\\python.new" "$INSTDIR\\python"' in nsi and "Function .onInstFailed" in nsi
    assert 'RMDir /r "$INSTDIR\\python"\n' not in nsi and 'RMDir /r "$INSTDIR\\python"' not in nsi.replace(
        'RMDir /r "$INSTDIR\\python.', "")
    assert "/SD IDCANCEL" in nsi                              # a silent install gives up instead of deleting


def test_no_makensis_error_without_payload(tmp_path):
    makensis = need_tool("makensis")
    p = run([makensis, "-V1", WINDOWS / "hivejet.nsi"], check=False)
    assert p.returncode != 0 and "PAYLOAD is not defined" in (p.stdout + p.stderr)


# ------------------------------------------------------------------------------------------------ workflows
def test_workflows_pass_actionlint():
    actionlint = need_tool("actionlint")
    files = sorted((REPO / ".github" / "workflows").glob("*.yml"))
    names = {f.name for f in files}
    assert {"windows-installer.yml", "linux-deb.yml"} <= names
    run([actionlint, "-no-color", *files], cwd=REPO)
    win = (REPO / ".github" / "workflows" / "windows-installer.yml").read_text()
    assert "runs-on: windows-latest" in win and "installer/windows/build.ps1" in win and "upload-artifact" in win
