"""`python -m app.gui [-m MODEL] [--smoke]`: the desktop app; --smoke opens the window for a second and exits 0
(the installers' post-install check)."""
import argparse
import sys

from app.gui import run_gui

p = argparse.ArgumentParser(prog="python -m app.gui")
p.add_argument("-m", "--model", default=None)
p.add_argument("--smoke", action="store_true", help="open the main window for a second, then exit 0")
a = p.parse_args()
sys.exit(run_gui(a.model, smoke=a.smoke))
