#!/bin/sh
# Build HiveJet's .deb:
#   installer/linux/build_deb.sh [--offline [--python-version X.Y] [--find-links DIR]] [--wheel FILE] [--out DIR]
#
# Builds the project's wheel (unless --wheel gives one), lays out the package tree and runs dpkg-deb. The
# package holds the wheel, the maintainer scripts, the launchers, the desktop entry and the icons; postinst
# makes /opt/hivejet/venv from it (see installer/linux/setup-env.sh and docs/INSTALL.md).
#   --offline           also carry a wheelhouse (/opt/hivejet/wheelhouse): every dependency and the pinned CPU
#                       build of PyTorch (app/gpu_stack.json), so that postinst needs no network at all. The
#                       wheels are compiled per Python version: the package then Depends on that python3 version.
#   --python-version    the target system's Python for --offline (default: PYTHON's; Debian 12: 3.11)
#   --find-links DIR    extra local wheels for --offline (e.g. a wheelhouse holding the CPU torch wheel)
# Needs: dpkg-deb, a Python >= 3.10 with pip (PYTHON, default: the repo's .venv, else python3).
# Prints the path of the .deb on its last line.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT="$REPO/dist"
WHEEL=""
OFFLINE=""
PYVER=""
FIND_LINKS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) WHEEL="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --offline) OFFLINE=1; shift ;;
    --python-version) PYVER="$2"; shift 2 ;;
    --find-links) FIND_LINKS="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "build_deb.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
command -v dpkg-deb >/dev/null || { echo "build_deb.sh: dpkg-deb is missing (apt-get install dpkg)" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/hivejet-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -z "$WHEEL" ]; then
  # --no-build-isolation where setuptools is at hand: no download, and a few seconds instead of half a minute.
  iso="--no-build-isolation"
  "$PYTHON" -c 'import setuptools, wheel' 2>/dev/null || "$PYTHON" -c 'import setuptools; assert int(setuptools.__version__.split(".")[0]) >= 70' 2>/dev/null || iso=""
  (cd "$REPO" && "$PYTHON" -m pip wheel -q --no-deps $iso -w "$WORK/wheel" .)
  WHEEL=$(ls "$WORK"/wheel/hivejet-*.whl)
fi
[ -f "$WHEEL" ] || { echo "build_deb.sh: no wheel at $WHEEL" >&2; exit 1; }
VERSION=$(basename "$WHEEL" | cut -d- -f2)

ROOT="$WORK/root"
install -d "$ROOT/DEBIAN" "$ROOT/opt/hivejet/wheels" "$ROOT/opt/hivejet/lib" "$ROOT/opt/hivejet/bin" \
  "$ROOT/usr/bin" "$ROOT/usr/share/applications" "$ROOT/usr/share/doc/hivejet" \
  "$ROOT/usr/share/icons/hicolor/scalable/apps" "$ROOT/usr/share/icons/hicolor/256x256/apps"
install -m 0644 "$WHEEL" "$ROOT/opt/hivejet/wheels/"
install -m 0755 "$HERE/setup-env.sh" "$ROOT/opt/hivejet/lib/setup-env.sh"
install -m 0755 "$HERE/bin/hivejet-launch" "$ROOT/opt/hivejet/bin/hivejet-launch"
install -m 0755 "$HERE/bin/hivejet" "$HERE/bin/hivejet-gpu-setup" "$ROOT/usr/bin/"
install -m 0644 "$HERE/hivejet.desktop" "$ROOT/usr/share/applications/hivejet.desktop"
install -m 0644 "$REPO/resources/icons/hivejet.svg" "$ROOT/usr/share/icons/hicolor/scalable/apps/hivejet.svg"
install -m 0644 "$REPO/resources/icons/hivejet.png" "$ROOT/usr/share/icons/hicolor/256x256/apps/hivejet.png"
install -m 0644 "$HERE/debian/copyright" "$ROOT/usr/share/doc/hivejet/copyright"
for s in postinst prerm postrm; do install -m 0755 "$HERE/debian/$s" "$ROOT/DEBIAN/$s"; done

# The pinned CPU build of PyTorch (app/gpu_stack.json): what postinst installs when the venv has no torch.
TORCH_SPEC=$("$PYTHON" -c "import json,sys; c=json.load(open(sys.argv[1]))['cpu']['linux']; print('torch==' + c['torch'] + ('+' + c['local'] if c['local'] else ''))" "$REPO/app/gpu_stack.json")
TORCH_INDEX=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['cpu']['linux']['index'])" "$REPO/app/gpu_stack.json")

PKG="hivejet"
PYDEP="python3 (>= 3.10)"
COMPRESS="-Zxz"
if [ -n "$OFFLINE" ]; then
  [ -n "$PYVER" ] || PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  WH="$ROOT/opt/hivejet/wheelhouse"
  install -d "$WH"
  fl=""
  [ -n "$FIND_LINKS" ] && fl="--find-links $FIND_LINKS"
  # PyTorch's CPU index, where it answers (pip would retry an unreachable index for every package, minutes);
  # else the CPU wheel has to come from --find-links or the configured indexes.
  if "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/', timeout=10)" "$TORCH_INDEX" 2>/dev/null; then
    fl="$fl --extra-index-url $TORCH_INDEX"
  else
    echo "build_deb.sh: $TORCH_INDEX does not answer: $TORCH_SPEC must come from --find-links or pip's configured indexes" >&2
  fi
  # One resolution for everything (torch pinned to the CPU build, so the resolver never takes PyPI's CUDA
  # torch), for the target Python on x86_64 Linux; pip too, so that the venv's pip can resume downloads later.
  # shellcheck disable=SC2086
  "$PYTHON" -m pip download -q --disable-pip-version-check --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --python-version "$PYVER" --implementation cp --dest "$WH" $fl \
    "$WHEEL" "$TORCH_SPEC" "pip>=25.1"
  rm -f "$WH"/hivejet-*.whl
  PYDEP="python3 (>= $PYVER), python3 (<< ${PYVER%.*}.$(( ${PYVER#*.} + 1 )))"
  # The wheels are zip files already: compressing them again gains about 1 % (xz took minutes for it).
  COMPRESS="-Znone"
fi
# Installed-Size: the package's files plus the environment postinst makes from them. Offline: the unpacked
# size of the wheelhouse's wheels (what pip installs) plus 17 % for the .pyc files pip compiles; online: the
# measured size of the venv with the CPU build. Measured with tests/installer/test_deb_debootstrap.py
# (du -sk /opt/hivejet after the offline install on Debian 12: 1634 MiB, of which 315 MiB wheelhouse).
VENV_KB=1350000
if [ -n "$OFFLINE" ]; then
  VENV_KB=$("$PYTHON" -c "import sys,zipfile,glob; print(int(1.17 * sum(i.file_size for w in glob.glob(sys.argv[1] + '/*.whl') for i in zipfile.ZipFile(w).infolist())) // 1024)" "$WH")
fi
SIZE=$(( $(du -sk --exclude=DEBIAN "$ROOT" | cut -f1) + VENV_KB ))
DL_MB=330    # the offline variant's wheelhouse: the same wheels, for Python 3.11
if [ -n "$OFFLINE" ]; then
  NOTE="This is the offline package: it carries every dependency and PyTorch's CPU build (for Python $PYVER), so the install needs no network. The CUDA build is offered at the first start of the app."
else
  NOTE="postinst downloads HiveJet's dependencies and PyTorch's CPU build (about $DL_MB MB) from PyPI and download.pytorch.org; without network the package still installs and the app finishes the setup (sudo hivejet-gpu-setup). The CUDA build is offered at the first start of the app."
fi
echo "$NOTE" | fold -s -w 72 | sed 's/ *$//; s/^/ /' > "$WORK/note"
sed -e "s/@VERSION@/$VERSION/" -e "s/@SIZE@/$SIZE/" -e "s/@PACKAGE@/$PKG/" -e "s/@PYDEP@/$PYDEP/" \
  "$HERE/debian/control.in" | awk -v note="$WORK/note" '$0 == "@NOTE@" { while ((getline l < note) > 0) print l; next } { print }' \
  > "$ROOT/DEBIAN/control"

SUFFIX=""
[ -n "$OFFLINE" ] && SUFFIX="_offline-py${PYVER}"
DEB="$OUT/hivejet_${VERSION}_all${SUFFIX}.deb"
# shellcheck disable=SC2086
dpkg-deb --root-owner-group $COMPRESS --build "$ROOT" "$DEB" >/dev/null
echo "$DEB"
