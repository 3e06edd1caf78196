#!/bin/sh
# Build HiveJet's .deb:   installer/linux/build_deb.sh [--wheel FILE] [--out DIR]
#
# Builds the project's wheel (unless --wheel gives one), lays out the package tree and runs dpkg-deb. The
# package holds the wheel, the maintainer scripts, the launchers, the desktop entry and the icons; postinst
# makes /opt/hivejet/venv from it (see installer/linux/setup-env.sh and docs/INSTALL.md).
# Needs: dpkg-deb, a Python >= 3.10 with pip (PYTHON, default: the repo's .venv, else python3).
# Prints the path of the .deb on its last line.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT="$REPO/dist"
WHEEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) WHEEL="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
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
SIZE=$(du -sk --exclude=DEBIAN "$ROOT" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@SIZE@/$SIZE/" "$HERE/debian/control.in" > "$ROOT/DEBIAN/control"

DEB="$OUT/hivejet_${VERSION}_all.deb"
dpkg-deb --root-owner-group -Zxz --build "$ROOT" "$DEB" >/dev/null
echo "$DEB"
