"""Planner page: the GPUs NVML sees (or CPU mode), and for the selected model a table of KV cache type x
context length with the memory each needs (engine/planner.py) and whether it fits, and the decode ceiling
the model implies on a card (engine/cards.py: the GPU in use, or one picked). Double-click (or
select + "Load with these settings") loads the model at that context."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget, QHeaderView)

from app import gpu as gpu_mod
from engine import cards as C
from engine import planner as P


class PlannerPage(QWidget):
    loadRequested = Signal(str, int, str, int)   # path, ctx, kv type, parallel chats

    def __init__(self, parent=None, parallel: int = 1):
        super().__init__(parent)
        self.setObjectName("Page")
        self.facts: P.ModelFacts | None = None
        self.table_plans: dict[str, list[P.Plan]] = {}
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        h = QLabel("VRAM planner")
        h.setObjectName("H1")
        lay.addWidget(h)
        self.gpu_card = QLabel()
        self.gpu_card.setObjectName("InfoBanner")
        self.gpu_card.setWordWrap(True)
        self.gpu_card.setTextFormat(Qt.RichText)
        lay.addWidget(self.gpu_card)
        row = QHBoxLayout()
        row.addWidget(QLabel("Model"))
        self.model_combo = QComboBox()
        self.model_combo.setMinimumWidth(360)
        self.model_combo.currentIndexChanged.connect(lambda *_: self.refresh())
        row.addWidget(self.model_combo, 1)
        row.addWidget(QLabel("Memory to plan for"))
        self.vram_edit = QLineEdit()
        self.vram_edit.setPlaceholderText("e.g. 24GiB")
        self.vram_edit.setFixedWidth(110)
        self.vram_edit.editingFinished.connect(self.refresh)
        row.addWidget(self.vram_edit)
        row.addWidget(QLabel("Parallel chats"))
        self.seqs = QSpinBox(minimum=1, maximum=64, value=parallel)   # (the app's: what a load from here uses)
        self.seqs.valueChanged.connect(lambda *_: self.refresh())
        row.addWidget(self.seqs)
        row.addWidget(QLabel("Card"))
        self.card_combo = QComboBox()
        for c in C.CARDS:
            self.card_combo.addItem(f"{c.name} ({c.bandwidth_gbs:.0f} GB/s)", c.key)
        self.card_combo.currentIndexChanged.connect(lambda *_: self.refresh())
        row.addWidget(self.card_combo)
        lay.addLayout(row)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setObjectName("Muted")
        lay.addWidget(self.summary)
        self.table = QTableWidget()
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        self.table.setSelectionBehavior(QTableWidget.SelectItems)
        self.table.cellDoubleClicked.connect(lambda r, c: self.load_cell(r, c))
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        self.table.verticalHeader().setDefaultSectionSize(34)
        lay.addWidget(self.table, 1)
        bottom = QHBoxLayout()
        self.legend = QLabel("Each cell: total memory (weights + KV cache + recurrent state + workspace, plus the "
                             "vision projector when the model has one). Green fits, "
                             "red does not, grey is past the model's trained context. Double-click a cell to load "
                             "the model with that context and KV cache type.")
        self.legend.setWordWrap(True)
        self.legend.setObjectName("Muted")
        bottom.addWidget(self.legend, 1)
        self.load_button = QPushButton("Load with these settings")
        self.load_button.setObjectName("Primary")
        self.load_button.clicked.connect(self._load_selected)
        bottom.addWidget(self.load_button)
        lay.addLayout(bottom)
        self.error = QLabel()
        self.error.setObjectName("ErrorText")
        lay.addWidget(self.error)
        self.refresh_gpus()

    def refresh_gpus(self):
        self.gpus, msg = gpu_mod.gpu_status()
        if self.gpus:
            lines = [f"<b>{g.name}</b> (GPU {g.index}): {P.fmt_bytes(g.total)} total, {P.fmt_bytes(g.free)} free · "
                     f"driver {g.driver} · CUDA {g.cuda}" for g in self.gpus]
            self.gpu_card.setText("<br>".join(lines))
            if not self.vram_edit.text():
                self.vram_edit.setText(f"{self.gpus[0].free / P.GiB:.1f}GiB")
            self._select_card(C.card_for_device(self.gpus[0].name, self.gpus[0].total))
        else:
            self.gpu_card.setText(f"<b>{msg}</b><br>HiveJet runs models on the CPU here (slowly). The table shows what "
                                  "a GPU would need; enter its memory (for example 24GiB) to see what fits.")
            if not self.vram_edit.text():
                self.vram_edit.setText("24GiB")
        self.cpu_mode = not self.gpus
        if self.card_combo.currentIndex() < 0 or not self.gpus:
            self._select_card(C.BY_KEY["rtx3090"])

    def _select_card(self, card: "C.Card | None"):
        """Show the ceiling on this card (the GPU in use when the table knows it; else the 24 GB RTX 3090)."""
        if card is not None:
            self.card_combo.setCurrentIndex(self.card_combo.findData(card.key))

    def ceiling_text(self) -> str:
        """The decode ceiling of the selected model on the selected card ("" without either)."""
        key = self.card_combo.currentData()
        if self.facts is None or not key or not self.facts.decode_read_bytes:
            return ""
        c = C.BY_KEY[key]
        return (f"decode ceiling on {c.name}: {C.decode_ceiling(self.facts.decode_read_bytes, c):.0f} tok/s for one "
                f"chat ({c.bandwidth_gbs:.0f} GB/s / {P.fmt_bytes(self.facts.decode_read_bytes)} of weights read per "
                "token)")

    def set_models(self, models: list[tuple[str, str]], select: str | None = None):
        """[(label, path)]"""
        cur = select or self.model_combo.currentData()
        self.model_combo.blockSignals(True)
        self.model_combo.clear()
        for label, path in models:
            self.model_combo.addItem(label, path)
        i = self.model_combo.findData(cur) if cur else -1
        self.model_combo.setCurrentIndex(max(i, 0))
        self.model_combo.blockSignals(False)
        self.refresh()

    def select_model(self, path: str):
        i = self.model_combo.findData(path)
        if i < 0:
            self.model_combo.addItem(path, path)
            i = self.model_combo.count() - 1
        self.model_combo.setCurrentIndex(i)
        self.refresh()

    def vram(self) -> int | None:
        t = self.vram_edit.text().strip()
        if not t:
            return None
        try:
            return P.parse_size(t)
        except ValueError:
            return None

    def refresh(self):
        self.error.clear()
        path = self.model_combo.currentData()
        self.table.clear()
        if not path:
            self.summary.setText("No model on disk yet: download or import one on the Models page.")
            return
        try:
            self.facts = f = P.model_facts(path)
        except Exception as e:
            self.facts = None
            self.error.setText(f"Cannot plan for this file: {e}")
            self.table.setRowCount(0)
            return
        vram = self.vram()
        if self.vram_edit.text().strip() and vram is None:
            self.error.setText(f"Cannot read a memory size from {self.vram_edit.text()!r}; try 24GiB.")
        n = self.seqs.value()
        self.table_plans = P.plan_table(f, vram, n_seqs=n)
        kvs = list(self.table_plans)
        self.table.setRowCount(len(kvs))
        self.table.setColumnCount(len(P.CONTEXTS) + 1)
        self.table.setHorizontalHeaderLabels([P.fmt_ctx(c) for c in P.CONTEXTS] + ["max context"])
        self.table.setVerticalHeaderLabels(kvs)
        for r, kt in enumerate(kvs):
            for c, p in enumerate(self.table_plans[kt]):
                it = QTableWidgetItem(f"{p.total / P.GiB:.2f} GiB")
                it.setTextAlignment(Qt.AlignCenter)
                it.setToolTip(f"weights {P.fmt_bytes(p.weights)}\nKV cache {P.fmt_bytes(p.kv)}\n"
                              f"recurrent state {P.fmt_bytes(p.recurrent)}\nworkspace {P.fmt_bytes(p.workspace)}"
                              + (f"\nvision projector {P.fmt_bytes(p.vision)}" if p.vision else "")
                              + (f"\nheadroom {P.fmt_bytes(p.headroom)}" if p.headroom is not None else ""))
                it.setData(Qt.UserRole, p.total)
                if p.ctx > f.context_length:
                    it.setForeground(QBrush(QColor("#9aa0a6")))
                    it.setToolTip("beyond the model's trained context (" + str(f.context_length) + ")")
                elif p.fits is True:
                    it.setBackground(QBrush(QColor(46, 160, 67, 60)))
                elif p.fits is False:
                    it.setBackground(QBrush(QColor(220, 38, 38, 55)))
                self.table.setItem(r, c, it)
            mc = P.max_context(f, kt, vram, n) if vram else None
            it = QTableWidgetItem("-" if mc is None else (f"{mc:,}" if mc else "does not fit"))
            it.setTextAlignment(Qt.AlignCenter)
            self.table.setItem(r, len(P.CONTEXTS), it)
        self.summary.setText(
            f"{f.name} · {f.arch}{' · ' + f.quant if f.quant else ''} · weights {P.fmt_bytes(f.weight_bytes)} · "
            f"{f.n_full_attn} full-attention + {f.n_swa} sliding-window + {f.n_recurrent_layers} recurrent layers · "
            f"trained context {f.context_length:,} · workspace allowance {P.fmt_bytes(P.workspace_bytes(f, n))}"
            + (f" · vision projector {P.fmt_bytes(f.vision_bytes)} (weights + image encoding)" if f.mmproj else "")
            + (" · " + self.ceiling_text() if self.ceiling_text() else "")
            + (" · CPU mode: nothing is placed on a GPU here" if self.cpu_mode else ""))

    def cell_plan(self, row: int, col: int) -> P.Plan | None:
        kvs = list(self.table_plans)
        if 0 <= row < len(kvs) and 0 <= col < len(P.CONTEXTS):
            return self.table_plans[kvs[row]][col]
        return None

    def _load_selected(self):
        items = self.table.selectedIndexes()
        if not items:
            self.error.setText("Select a cell first (a KV type and a context length).")
            return
        self.load_cell(items[0].row(), items[0].column())

    def load_cell(self, row: int, col: int):
        p = self.cell_plan(row, col)
        if p is None or self.facts is None:
            return
        ctx = min(p.ctx, self.facts.context_length)
        self.loadRequested.emit(self.model_combo.currentData(), ctx, p.kv_type, self.seqs.value())
