#!/bin/sh
# HiveJet's private Python environment: /opt/hivejet/venv. Run by the .deb's postinst (as root) on install and
# on every upgrade, and by hand to repair it: sudo /opt/hivejet/lib/setup-env.sh
#
#  1. (re)creates the venv with the system python3 (again when the system's Python version changed);
#  2. installs the HiveJet wheel shipped in /opt/hivejet/wheels (no dependencies yet);
#  3. runs the GPU setup (python -m app.firstrun setup): the PyTorch build for this machine's NVIDIA driver,
#     or the CPU build when there is no suitable GPU, so torch is downloaded once, in the right build;
#  4. installs HiveJet's other dependencies from PyPI (torch is already satisfied).
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
say() { echo "hivejet: $*"; }

WHEEL=""
for w in "$PREFIX"/wheels/hivejet-*.whl; do [ -f "$w" ] && WHEEL="$w"; done
[ -n "$WHEEL" ] || { say "no HiveJet wheel in $PREFIX/wheels" >&2; exit 1; }
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
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check ${PIP_QUIET:--q} "$@" $PIP_ARGS; }
# pip >= 24.1 reports download progress line by line (the GPU setup window shows it); best effort.
pip install --upgrade "pip>=24.1" >/dev/null 2>&1 || true
say "installing $(basename "$WHEEL")"
pip install --no-deps --force-reinstall --no-warn-script-location "$WHEEL"

fr=""
for a in $PIP_ARGS; do fr="$fr --pip-arg=$a"; done
say "GPU setup (PyTorch build for this machine)"
# shellcheck disable=SC2086
"$VENV/bin/python" -m app.firstrun setup --yes $fr || {
  say "the PyTorch download failed: check the internet connection, then run: sudo dpkg --configure -a" >&2
  exit 1
}
say "installing HiveJet's other dependencies"
pip install --no-warn-script-location "$WHEEL"
"$VENV/bin/hivejet" --version
