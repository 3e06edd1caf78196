"""Monitor page: one row per active conversation/agent from engine.stats() (tok/s, context used, state,
last output line), total tok/s over time, the engine's step, KV pool and draft acceptance figures, and GPU utilisation,
memory, temperature and power from NVML (or a clear CPU-mode note)."""
from __future__ import annotations

import collections
import math
import os

from PySide6.QtCore import QPointF, QRectF, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (QGridLayout, QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from app import gpu as gpu_mod
from engine.planner import fmt_bytes


def nice_top(v: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above v (at least 1): the y axis' top."""
    v = max(v, 1.0)
    mag = 10 ** math.floor(math.log10(v))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= v)


class Sparkline(QWidget):
    """Total tok/s over the last `n` samples (one a second), with a y axis in tok/s and a time axis."""

    def __init__(self, n=121, interval_s: float = 1.0):     # 121 samples a second apart: the last 120 s
        super().__init__()
        self.values = collections.deque(maxlen=n)
        self.interval_s = interval_s
        self.setMinimumHeight(140)

    def add(self, v: float):
        self.values.append(v)
        self.update()

    def ticks(self) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
        """(y ticks as (value, label), x ticks as (fraction of the width from the left, label))."""
        top = nice_top(max(self.values, default=0.0))
        ys = [(top * k / 4, f"{top * k / 4:g}") for k in range(5)]
        span = (self.values.maxlen - 1) * self.interval_s
        xs = [(k / 4, f"-{span * (1 - k / 4):.0f} s" if k < 4 else "now") for k in range(5)]
        return ys, xs

    def paintEvent(self, e):
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing)
        fm = p.fontMetrics()
        left = fm.horizontalAdvance("00000") + 14
        r = QRectF(self.rect()).adjusted(left, 22, -12, -2 * fm.height() - 6)
        pal = self.palette()
        text, grid = pal.text().color(), pal.mid().color()
        ys, xs = self.ticks()
        top = ys[-1][0]
        p.setPen(text)
        p.drawText(QRectF(0, 2, self.width(), 18), Qt.AlignLeft | Qt.AlignVCenter,
                   f"  total tok/s (all conversations), last {(self.values.maxlen - 1) * self.interval_s:.0f} s · "
                   f"peak {max(self.values, default=0.0):.1f}")
        for v, lab in ys:
            y = r.bottom() - v / top * r.height()
            p.setPen(QPen(grid, 1, Qt.DotLine))
            p.drawLine(QPointF(r.left(), y), QPointF(r.right(), y))
            p.setPen(text)
            p.drawText(QRectF(0, y - fm.height() / 2, left - 6, fm.height()), Qt.AlignRight | Qt.AlignVCenter, lab)
        for f, lab in xs:
            x = r.left() + f * r.width()
            p.setPen(QPen(grid, 1))
            p.drawLine(QPointF(x, r.bottom()), QPointF(x, r.bottom() + 4))
            p.setPen(text)
            w = fm.horizontalAdvance(lab) + 4
            p.drawText(QRectF(x - w / 2, r.bottom() + 5, w, fm.height()), Qt.AlignCenter, lab)
        p.setPen(QPen(text, 1))
        p.drawLine(r.bottomLeft(), r.bottomRight())
        p.drawLine(r.bottomLeft(), r.topLeft())
        p.drawText(QRectF(r.left(), r.bottom() + fm.height() + 6, r.width(), fm.height()), Qt.AlignCenter, "time")
        vals = list(self.values)
        if len(vals) < 2:
            return
        n = self.values.maxlen
        path = QPainterPath()
        for i, v in enumerate(vals):
            x = r.right() - (len(vals) - 1 - i) * r.width() / (n - 1)
            y = r.bottom() - v / top * r.height()
            path.moveTo(x, y) if i == 0 else path.lineTo(x, y)
        p.setPen(QPen(QColor("#f59e0b"), 2))
        p.drawPath(path)


class MonitorPage(QWidget):
    def __init__(self, controller, store, parent=None):
        super().__init__(parent)
        self.setObjectName("Page")
        self.ctl, self.store = controller, store
        self.last_lines: dict[str, str] = {}
        self.live = lambda session: None     # set by the main window: the chat's streaming text
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        h = QLabel("Monitor")
        h.setObjectName("H1")
        lay.addWidget(h)
        self.engine_label = QLabel("No model loaded.")
        self.engine_label.setObjectName("Muted")
        lay.addWidget(self.engine_label)
        self.table = QTableWidget(0, 6)
        self.table.setHorizontalHeaderLabels(["Conversation / agent", "State", "tok/s", "Context used", "Generated",
                                              "Last output"])
        self.table.horizontalHeader().setSectionResizeMode(5, QHeaderView.Stretch)
        for col in range(5):
            self.table.horizontalHeader().setSectionResizeMode(col, QHeaderView.ResizeToContents)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        lay.addWidget(self.table, 2)
        self.spark = Sparkline()
        lay.addWidget(self.spark, 1)
        grid = QGridLayout()
        self.cards = {}
        for i, (key, title) in enumerate((("step", "Engine step"), ("pool", "KV pool"), ("draft", "Draft acceptance"),
                                          ("gpu", "GPU"), ("mem", "Memory"), ("temp", "Temperature · power"))):
            box = QLabel()
            box.setObjectName("Card")
            box.setWordWrap(True)
            box.setMinimumHeight(64)
            box.setTextFormat(Qt.RichText)
            box.setMargin(10)
            grid.addWidget(box, i // 3, i % 3)
            self.cards[key] = (box, title)
        lay.addLayout(grid)
        self.timer = QTimer(self, interval=1000, timeout=self.refresh)
        self.timer.start()
        self.refresh()

    def _card(self, key, text):
        box, title = self.cards[key]
        box.setText(f"<b>{title}</b><br>{text}")

    def note_output(self, session: str, text: str):
        line = [s for s in text.strip().splitlines() if s.strip()]
        if line:
            self.last_lines[session] = line[-1][:160]

    def refresh(self):
        eng = self.ctl.engine
        total = 0.0
        if eng is None:
            self.engine_label.setText("No local model loaded." if not self.ctl.remote else
                                      f"Chatting with a remote endpoint ({self.ctl.remote.base_url}); "
                                      "it reports no engine statistics.")
            self.table.setRowCount(0)
            self._card("step", "-")
        else:
            st = eng.stats()
            self.engine_label.setText(f"{st['model']} · {st['arch']} · {st['device']} · context {st['ctx_size']:,} · "
                                      f"{st['running']} running, {st['waiting']} waiting")
            seqs = st["sequences"]
            self.table.setRowCount(len(seqs))
            for r, s in enumerate(seqs):
                sess = s.get("session") or f"request {s['id']}"
                c = self.store.get_conversation(sess) if s.get("session") else None
                name = c.title if c else sess
                total += s["tok_per_s"]
                live = self.live(s.get("session") or "")
                if live:
                    self.note_output(s["session"], live)
                vals = [name, s["state"], f"{s['tok_per_s']:.1f}",
                        f"{s['context']:,} / {s['ctx_limit']:,} ({100 * s['context'] / max(s['ctx_limit'], 1):.1f}%)",
                        str(s["generated"]), self.last_lines.get(s.get("session") or "", "")]
                for col, v in enumerate(vals):
                    self.table.setItem(r, col, QTableWidgetItem(v))
            ls, tot = st["last_step"], st["totals"]
            self._card("step", f"{ls['rows']} rows · {ls['seqs']} sequences · {ls['ms']:.0f} ms<br>"
                               f"{tot.get('steps', 0):,} steps · {tot.get('generated_tokens', 0):,} tokens generated")
        self.spark.add(total)
        st = eng.stats() if eng is not None else None
        self._card("pool", pool_text(st) if st else "-")
        self._card("draft", draft_text(st) if st else "-")
        s = gpu_mod.sample(0)
        if s is None:
            _, msg = gpu_mod.gpu_status()
            self._card("gpu", msg)
            self._card("temp", "-")
        else:
            self._card("gpu", f"{s.util_pct:.0f}% busy" if s.util_pct is not None else "-")
            self._card("temp", f"{s.temp_c or 0:.0f} °C · {s.power_w or 0:.0f} W of {s.power_limit_w or 0:.0f} W")
        rss = _rss()
        mem = f"this app: {fmt_bytes(rss)} resident" if rss else ""
        if s is not None and s.mem_used is not None:
            mem += f"<br>GPU: {fmt_bytes(s.mem_used)} / {fmt_bytes(s.mem_total)}"
        self._card("mem", mem or "-")


def pool_text(st: dict) -> str:
    """The KV card: the GPU path's shared pool (tokens used of its size, blocks shared by several
    conversations, blocks parked conversations keep, long prompts' chunks held back for generating
    conversations: engine/pacing.py, recurrent-state checkpoints), or the CPU path's pool (its fixed limit,
    the tokens in use) and resident conversations."""
    kp = st.get("kv_pool")
    res = st.get("resident") or {}
    parked = f"{res.get('conversations', 0)} conversations kept for follow-ups ({res.get('tokens', 0):,} tokens)"
    if not kp:
        return f"CPU path · {parked}"
    if kp.get("path") == "cpu":      # the CPU pool's fixed limit; its use includes the conversations kept
        cap = max(kp.get("capacity_tokens") or 0, 1)
        used = kp.get("used_tokens", 0)
        return f"CPU path · {used:,} of {cap:,} tokens ({100 * used / cap:.1f}%)<br>{parked}"
    cap = max(kp.get("capacity_tokens") or 0, 1)
    used = kp.get("used_tokens", 0)
    pacing = st.get("prefill_pacing") or {}
    held = (f"<br>long prompts: {pacing.get('chunks_held', 0):,} chunks held back for generating conversations"
            if pacing.get("share", 1) < 1 else "<br>long prompts: not paced")
    ck = kp.get("state_checkpoints")
    ckpt = (f"<br>recurrent-state checkpoints: {ck['kept']} of {ck['max']} in "
            f"{'RAM' if ck['memory'] == 'host' else 'GPU memory'} ({fmt_bytes(ck['bytes'])})" if ck else "")
    return (f"{used:,} of {cap:,} tokens ({100 * used / cap:.1f}%)<br>"
            f"{kp.get('shared', 0):,} blocks shared · {kp.get('parked_blocks', 0):,} parked · {parked}{held}{ckpt}")


def draft_text(st: dict) -> str:
    """The speculative decoding card: off, or each drafter's accepted share of its drafts."""
    sp = st.get("spec") or {}
    if sp.get("mode", "off") == "off":
        return "off (Settings: speculative decoding)"
    by = sp.get("drafters") or {}
    if not by:
        return f"{sp['mode']}: no drafts yet"
    return "<br>".join(f"{name}: {100 * d['acceptance']:.0f}% of {d['drafted']:,} drafts accepted"
                       for name, d in sorted(by.items()))


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0
