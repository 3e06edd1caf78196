#!/bin/sh
# HiveJet's private Python environment: /opt/hivejet/venv. Run by the .deb's postinst (as root) on install and
# on every upgrade, and by hand to finish or repair it: sudo /opt/hivejet/lib/setup-env.sh
#
#  1. (re)creates the venv with the system python3 (again when the system's Python version changed);
#  2. installs the HiveJet wheel shipped in /opt/hivejet/wheels (no dependencies yet);
#  3. installs PyTorch's pinned CPU build (app/gpu_stack.json) only when the venv has no torch at all: a
#     reinstall or an upgrade never replaces the build there (the CUDA build the user chose at the first start,
#     or the CPU build of "Always use the CPU"). The CUDA build is never downloaded here: the app offers it at
#     its first start, with a progress window and a retry;
#  4. installs HiveJet's other dependencies.
# Where /opt/hivejet/wheelhouse exists (the offline .deb, build_deb.sh --offline), pip uses only it: no
# network at all. Otherwise steps 3-4 download from PyPI and PyTorch's CPU index; when that fails, the venv
# is marked incomplete (venv/hivejet-incomplete holds the reason), `hivejet` says how to finish it, and this
# script exits 3 (postinst reports it and lets apt finish: apt is never left with a half-configured package).
#
# Environment (tests and special setups): HIVEJET_PREFIX (default /opt/hivejet), HIVEJET_PYTHON (default
# python3), HIVEJET_PIP_ARGS (extra pip arguments, e.g. "--no-index --find-links /some/wheelhouse"),
# HIVEJET_INHERIT_SITE (site-packages folders, ':'-separated, that the venv also sees, through a .pth file: the CI test reuses its
# own torch and Qt instead of downloading them), HIVEJET_NVIDIA_SMI (nvidia-smi to ask; empty: none).
set -eu
PREFIX="${HIVEJET_PREFIX:-/opt/hivejet}"
PY="${HIVEJET_PYTHON:-python3}"
VENV="$PREFIX/venv"
PIP_ARGS="${HIVEJET_PIP_ARGS:-}"
INCOMPLETE="$VENV/hivejet-incomplete"
say() { echo "hivejet: $*"; }
# root's pip cache would outlive a purge: none
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WHEEL=""
for w in "$PREFIX"/wheels/hivejet-*.whl; do [ -f "$w" ] && WHEEL="$w"; done
[ -n "$WHEEL" ] || { say "no HiveJet wheel in $PREFIX/wheels" >&2; exit 1; }
if [ -d "$PREFIX/wheelhouse" ]; then
  PIP_ARGS="--no-index --find-links $PREFIX/wheelhouse $PIP_ARGS"
fi
command -v "$PY" >/dev/null 2>&1 || { say "$PY is missing: install python3 (>= 3.10)" >&2; exit 1; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { say "HiveJet needs Python >= 3.10" >&2; exit 1; }
want=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

if [ -e "$VENV" ]; then
  have=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo broken)
  if [ "$have" != "$want" ]; then
    say "the environment was made for Python $have, the system has $want: making it again"
    rm -rf "$VENV"
  fi
fi
# With HIVEJET_INHERIT_SITE the venv gets no pip or setuptools of its own (they would shadow the inherited,
# newer ones): the inherited pip installs into it.
venv_args=""
[ -n "${HIVEJET_INHERIT_SITE:-}" ] && venv_args="--without-pip"
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV (Python $want)"
  "$PY" -m venv $venv_args "$VENV" || { say "python3 -m venv failed: install python3-venv" >&2; rm -rf "$VENV"; exit 1; }
fi
if [ -n "${HIVEJET_INHERIT_SITE:-}" ]; then
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$HIVEJET_INHERIT_SITE" | tr ':' '\n' > "$site/_hivejet_inherit.pth"
fi

# shellcheck disable=SC2086  # PIP_ARGS is a list of words
pip() { "$VENV/bin/python" -m pip ${PIP_QUIET:--q} "$@" $PIP_ARGS; }
# pip >= 25.1 resumes cut-off downloads and reports progress line by line (the GPU setup window shows it);
# best effort, with a short timeout: no network must not make this slow.
PIP_DEFAULT_TIMEOUT=15 PIP_RETRIES=1 pip install --upgrade "pip>=25.1" >/dev/null 2>&1 || true
say "installing $(basename "$WHEEL")"
pip install --no-deps --force-reinstall --no-warn-script-location "$WHEEL"

incomplete() {
  echo "$1" > "$INCOMPLETE"
  say "$1" >&2
  say "HiveJet is installed but cannot run yet. Finish the setup when the network is back:" >&2
  say "    sudo $PREFIX/lib/setup-env.sh" >&2
  exit 3
}
fr=""
for a in $PIP_ARGS; do fr="$fr --pip-arg=$a"; done
say "PyTorch (the CPU build, unless a build is installed already)"
# The offline package's wheelhouse is the download folder itself: nothing is copied, nothing downloaded.
cache=""
[ -d "$PREFIX/wheelhouse" ] && cache="--cache $PREFIX/wheelhouse"
# shellcheck disable=SC2086
"$VENV/bin/python" -m app.firstrun setup --yes --flavor cpu --if-missing $cache $fr ||
  incomplete "the PyTorch download failed (see above)"
say "installing HiveJet's other dependencies"
pip install --no-warn-script-location "$WHEEL" || incomplete "installing HiveJet's dependencies failed (see above)"
rm -f "$INCOMPLETE"
"$VENV/bin/hivejet" --version
