"""Draw HiveJet's icon (a honeycomb hexagon with a jet streak) as SVG, PNG sizes and a Windows .ico.

    .venv/bin/python installer/common/make_icons.py      # writes resources/icons/hivejet.{svg,png,ico}

The files are committed; run this only to change the icon. Needs Pillow (a HiveJet dependency)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "resources" / "icons"
BG, FG, JET = "#F5A623", "#1B1F2A", "#FFFFFF"


def hexagon(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    return [(cx + r * math.cos(math.radians(60 * i - 30)), cy + r * math.sin(math.radians(60 * i - 30)))
            for i in range(6)]


def svg() -> str:
    outer = " ".join(f"{x:.1f},{y:.1f}" for x, y in hexagon(128, 128, 120))
    inner = " ".join(f"{x:.1f},{y:.1f}" for x, y in hexagon(128, 128, 78))
    return f"""<svg xmlns="http://www.w3.org/2000/svg" width="256" height="256" viewBox="0 0 256 256">
  <polygon points="{outer}" fill="{BG}"/>
  <polygon points="{inner}" fill="{FG}"/>
  <polygon points="84,150 172,92 150,128 184,128 96,182 118,150" fill="{JET}"/>
</svg>
"""


def png(size: int):
    from PIL import Image, ImageDraw
    s = 4 * size                       # draw large, downsample: smooth edges without an SVG renderer
    img = Image.new("RGBA", (s, s), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    k = s / 256
    d.polygon([(x * k, y * k) for x, y in hexagon(128, 128, 120)], fill=BG)
    d.polygon([(x * k, y * k) for x, y in hexagon(128, 128, 78)], fill=FG)
    d.polygon([(x * k, y * k) for x, y in [(84, 150), (172, 92), (150, 128), (184, 128), (96, 182), (118, 150)]],
              fill=JET)
    return img.resize((size, size), Image.LANCZOS)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "hivejet.svg").write_text(svg())
    png(256).save(OUT / "hivejet.png")
    big = png(256)
    big.save(OUT / "hivejet.ico", sizes=[(16, 16), (24, 24), (32, 32), (48, 48), (64, 64), (128, 128), (256, 256)])
    print("\n".join(str(p) for p in sorted(OUT.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
