"""The main window: a top bar (model picker with the loaded model's state and load progress/cancel, the
server switch), a navigation rail, and the pages (Chat, Models, Planner, Monitor, Server, Settings)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from PySide6.QtCore import QSize, Qt, QTimer
from PySide6.QtGui import QAction, QIcon, QKeySequence, QPixmap
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QFrame, QHBoxLayout, QLabel, QListWidget,
                               QListWidgetItem, QMainWindow, QProgressBar, QPushButton, QStackedWidget, QVBoxLayout,
                               QWidget)

from app import gpu as gpu_mod
from app.gui.chat import ChatPage
from app.gui.controller import EngineController, pacing_share, parallel_conversations
from app.gui.icons import icon
from app.gui.models_page import ModelsPage
from app.gui.monitor_page import MonitorPage
from app.gui.planner_page import PlannerPage
from app.gui.server_page import ServerPage
from app.gui.settings_page import SettingsPage
from app.gui.theme import RESOURCES, apply_theme
from app.store import Store

PAGES = ("Chat", "Models", "Planner", "Monitor", "Server", "Settings")
ICONS = {"Chat": "chat", "Models": "models", "Planner": "planner", "Monitor": "monitor", "Server": "server",
         "Settings": "settings"}     # resources/icons/*.svg


def suggest_model(gpus) -> dict | None:
    """The largest suggested model whose minimum VRAM the first GPU has (resources/suggested_models.json)."""
    if not gpus:
        return None
    data = json.loads((RESOURCES / "suggested_models.json").read_text())
    gib = gpus[0].total / (1 << 30)
    for m in data["models"]:
        if gib >= m["min_vram_gib"]:
            return m
    return None


class MainWindow(QMainWindow):
    def __init__(self, store: Store | None = None, model: str | None = None, autoload: bool = True):
        super().__init__()
        self.store = store or Store()
        md = self.store.get_setting("models_dir")
        if md and not os.environ.get("HIVEJET_MODELS"):
            os.environ["HIVEJET_MODELS"] = md
        self.setWindowTitle("HiveJet")
        self.resize(1320, 840)
        icon = RESOURCES / "icons" / "hivejet.png"
        if icon.exists():
            self.setWindowIcon(QIcon(str(icon)))
        self.ctl = EngineController(threads=int(self.store.get_setting("threads", 0)))
        self.gpus, self.gpu_msg = gpu_mod.gpu_status()
        self._build()
        self.ctl.loadStarted.connect(self._on_load_started)
        self.ctl.loadProgress.connect(lambda m: self.state_label.setText(m))
        self.ctl.loaded.connect(self._on_loaded)
        self.ctl.loadFailed.connect(self._on_load_failed)
        self.ctl.loadCancelled.connect(self._on_load_cancelled)
        self.chat.replyFinished.connect(self._on_reply)
        self.monitor.live = self.chat.live_text
        self._first_run()
        self.refresh_models()
        convs = self.store.list_conversations()
        if convs:
            self.chat.open_conversation(convs[0].id)
        if autoload:
            target = model or self.store.get_setting("last_model") or "demo"
            if model is None and target != "demo" and not Path(target).exists():
                target = "demo"
            QTimer.singleShot(0, lambda: self.load_model(target))

    # ----- layout -----
    def _build(self):
        central = QWidget()
        v = QVBoxLayout(central)
        v.setContentsMargins(0, 0, 0, 0)
        v.setSpacing(0)
        v.addWidget(self._build_top_bar())
        v.addLayout(self._build_pages(), 1)
        self.setCentralWidget(central)
        self.nav.currentRowChanged.connect(self.stack.setCurrentIndex)
        self.nav.setCurrentRow(0)
        self._wire_pages()
        self._add_shortcuts()
        self.statusBar().showMessage("Ready")

    def _build_top_bar(self) -> QFrame:
        """Logo, model picker, the loaded model's state, load progress + Cancel, Eject, device, server switch."""
        top = QFrame()
        top.setObjectName("TopBar")
        tl = QHBoxLayout(top)
        tl.setContentsMargins(14, 8, 14, 8)
        logo = QLabel()
        logo_file = RESOURCES / "icons" / "hivejet.png"
        if logo_file.exists():
            logo.setPixmap(QPixmap(str(logo_file)).scaled(22, 22, Qt.KeepAspectRatio, Qt.SmoothTransformation))
        tl.addWidget(logo)
        brand = QLabel("HiveJet")
        brand.setObjectName("Brand")
        tl.addWidget(brand)
        tl.addSpacing(18)
        self.model_combo = QComboBox()
        self.model_combo.setMinimumWidth(330)
        self.model_combo.setToolTip("Pick a model to load")
        self.model_combo.activated.connect(self._picked)
        tl.addWidget(self.model_combo)
        self.state_label = QLabel("No model loaded")
        self.state_label.setObjectName("Muted")
        tl.addWidget(self.state_label)
        self.load_bar = QProgressBar()
        self.load_bar.setRange(0, 0)
        self.load_bar.setFixedWidth(120)
        self.load_bar.hide()
        tl.addWidget(self.load_bar)
        self.cancel_load_button = QPushButton("Cancel")
        self.cancel_load_button.clicked.connect(self.ctl.cancel_load)
        self.cancel_load_button.hide()
        tl.addWidget(self.cancel_load_button)
        self.eject_button = QPushButton("Eject")
        self.eject_button.setToolTip("Unload the model and free its memory")
        self.eject_button.clicked.connect(self._eject)
        self.eject_button.hide()
        tl.addWidget(self.eject_button)
        tl.addStretch(1)
        self.device_label = QLabel(self.gpus[0].name if self.gpus else "CPU mode")
        self.device_label.setObjectName("Muted")
        self.device_label.setToolTip(self.gpu_msg or "")
        tl.addWidget(self.device_label)
        tl.addSpacing(16)
        self.server_switch = QCheckBox("Local server")
        self.server_switch.setObjectName("Switch")
        tl.addWidget(self.server_switch)
        return top

    def _build_pages(self) -> QHBoxLayout:
        """The navigation rail and the pages."""
        body = QHBoxLayout()
        body.setSpacing(0)
        self.nav = QListWidget()
        self.nav.setObjectName("NavRail")
        self.nav.setFixedWidth(150)
        self.nav.setIconSize(QSize(18, 18))
        for p in PAGES:
            self.nav.addItem(QListWidgetItem(icon(ICONS[p]), p))
        body.addWidget(self.nav)
        self.stack = QStackedWidget()
        self.chat = ChatPage(self.store, self.ctl)
        self.models = ModelsPage(self.store, vram_getter=self._vram)
        self.planner = PlannerPage(parallel=parallel_conversations(self.store))
        self.monitor = MonitorPage(self.ctl, self.store)
        self.server = ServerPage(self.store, self.ctl)
        self.settings = SettingsPage(self.store)
        for w in (self.chat, self.models, self.planner, self.monitor, self.server, self.settings):
            self.stack.addWidget(w)
        body.addWidget(self.stack, 1)
        return body

    def _wire_pages(self) -> None:
        """What the pages tell each other and the window."""
        self.models.loadRequested.connect(self.load_model)
        self.models.planRequested.connect(self._plan_for)
        self.models.libraryChanged.connect(self.refresh_models)
        self.models.folderChanged.connect(lambda d: self.settings.folder.setText(d))
        self.planner.loadRequested.connect(self._load_from_planner)
        # the planner plans for the parallel conversations the next load takes (a change in Settings shows there)
        self.settings.parallel.valueChanged.connect(self.planner.seqs.setValue)
        self.settings.themeChanged.connect(lambda mode: apply_theme(QApplication.instance(), mode))
        self.settings.folderChosen.connect(self.models.set_folder)
        self.settings.remoteChosen.connect(self._use_remote)
        self.server_switch.toggled.connect(self._switch_toggled)
        self.server.stateChanged.connect(self._server_state)

    def _add_shortcuts(self) -> None:
        """Ctrl+1..6 pages, Ctrl+N new chat, Ctrl+Q quit."""
        for i, p in enumerate(PAGES):
            act = QAction(self)
            act.setShortcut(QKeySequence(f"Ctrl+{i + 1}"))
            act.triggered.connect(lambda _=False, i=i: self.nav.setCurrentRow(i))
            self.addAction(act)
        new = QAction(self)
        new.setShortcut(QKeySequence.New)
        new.triggered.connect(lambda: (self.nav.setCurrentRow(0), self.chat.new_conversation()))
        self.addAction(new)
        self.quit_action = QAction("Quit", self)
        self.quit_action.setShortcut(QKeySequence("Ctrl+Q"))
        self.quit_action.setShortcutContext(Qt.ApplicationShortcut)
        self.quit_action.triggered.connect(self.close)
        self.addAction(self.quit_action)

    def show_page(self, name: str):
        self.nav.setCurrentRow(PAGES.index(name))

    def _vram(self):
        if self.gpus:
            return self.gpus[0].free, False
        return None, True

    def _first_run(self):
        if self.store.get_setting("first_run_done"):
            return
        self.store.set_setting("first_run_done", True)
        sug = suggest_model(self.gpus)
        if sug:
            g = self.gpus[0]
            text = (f"Welcome to HiveJet. Your {g.name} has {g.total / (1 << 30):.0f} GB: {sug['name']} fits it "
                    f"(about {sug['size_gib']} GB). Find it on the Models page (search “{sug['search']}”). "
                    "Meanwhile you are chatting with the small demo model.")
            self.models.search_edit.setText(sug["search"])
        else:
            text = ("Welcome to HiveJet. " + (self.gpu_msg or "No NVIDIA GPU: CPU mode") + ". You are chatting with "
                    "the small demo model (SmolLM2-135M), which runs on any CPU. Larger models need an NVIDIA GPU; "
                    "the Planner page shows what fits.")
        self.chat.banner.setText(text)
        self.chat.banner.show()

    # ----- models -----
    def refresh_models(self):
        cur = self.model_combo.currentData()
        self.model_combo.blockSignals(True)
        self.model_combo.clear()
        entries = []
        for m in self.models.loadable():
            entries.append((f"{m.name}  ·  {m.quant}  ·  {m.path.stat().st_size / 1e9:.2f} GB", str(m.path)))
        from engine.catalog import CATALOG, models_dir
        demo_path = models_dir() / CATALOG["demo"].filename
        if not any(Path(p) == demo_path for _, p in entries):
            entries.insert(0, ("Demo: SmolLM2-135M-Instruct (downloads 100 MB once)", "demo"))
        for label, path in entries:
            self.model_combo.addItem(label, path)
        for r in self.store.get_setting("remotes", []):
            for m in r.get("models", []):
                self.model_combo.addItem(icon("cloud"), f"{m} · {r['url']}", json.dumps(dict(url=r["url"], key=r.get("key", ""),
                                                                                 model=m)))
        i = self.model_combo.findData(cur)
        if i >= 0:
            self.model_combo.setCurrentIndex(i)
        self.model_combo.blockSignals(False)
        self.planner.set_models([(l, p) for l, p in entries if p != "demo"] or [], None)

    def _picked(self, i):
        data = self.model_combo.itemData(i)
        if data and data.startswith("{"):
            from app.gui.controller import RemoteBackend
            r = json.loads(data)
            self._use_remote(RemoteBackend(r["url"], r["model"], r["key"]))
        elif data:
            self.load_model(data)

    def load_model(self, model: str, ctx_size: int = 0, kv_cache: str | None = None):
        if self.chat.generating:
            self.chat.stop()
        self.ctl.threads = int(self.store.get_setting("threads", 0))
        self.ctl.load(model, ctx_size, kv_cache=kv_cache, mmproj="auto",
                      spec=str(self.store.get_setting("spec", "off")),
                      prefill_share=pacing_share(self.store.get_setting("prefill_share", 0.5)),
                      max_seqs=parallel_conversations(self.store))

    def _load_from_planner(self, path: str, ctx: int, kv: str, n_seqs: int):
        # the plan's parallel chats are what loads (its memory was planned for them), now and later
        self.store.set_setting("parallel", n_seqs)
        self.settings.parallel.setValue(n_seqs)
        self.load_model(path, ctx, kv_cache=kv)
        self.show_page("Chat")

    def _plan_for(self, path: str):
        self.planner.select_model(path)
        self.show_page("Planner")

    def _on_load_started(self, model):
        self.state_label.setText(f"Loading {Path(model).name} …")
        self.load_bar.show()
        self.cancel_load_button.show()
        self.eject_button.hide()
        self.model_combo.setEnabled(False)

    def _load_done_ui(self):
        self.load_bar.hide()
        self.cancel_load_button.hide()
        self.model_combo.setEnabled(True)

    def _on_loaded(self, info):
        self._load_done_ui()
        self.eject_button.show()
        where = "remote" if info.remote else info.device.upper()
        self.state_label.setText(f"● {info.name} · context {info.ctx_size:,} · {where}"
                                 + (" · sees images" if info.vision else ""))
        if not info.remote:
            self.store.set_setting("last_model", info.path)
            i = self.model_combo.findData(info.path)
            if i < 0:
                self.refresh_models()
                i = self.model_combo.findData(info.path)
            if i >= 0:
                self.model_combo.setCurrentIndex(i)
        msg = f"Loaded {info.name}"
        if info.kv_cache != "f16" and not info.remote:
            msg += f" · KV cache {info.kv_cache}"
        if info.drafts:
            msg += f" · drafts: {info.drafts}"
        if info.spec_note:
            msg += f" · {info.spec_note}"
        self.statusBar().showMessage(msg, 8000)
        self.server._update_texts()

    def _on_load_failed(self, err):
        self._load_done_ui()
        self.state_label.setText("Load failed")
        self.statusBar().showMessage(f"Could not load the model: {err}")
        self.chat.error_label.setText(f"Could not load the model: {err}")
        if self.ctl.info:
            self.state_label.setText(f"● {self.ctl.info.name} · context {self.ctl.info.ctx_size:,}")
            self.eject_button.show()

    def _on_load_cancelled(self):
        self._load_done_ui()
        self.statusBar().showMessage("Loading cancelled", 5000)
        if self.ctl.info:
            self.state_label.setText(f"● {self.ctl.info.name} · context {self.ctl.info.ctx_size:,}")
            self.eject_button.show()
        else:
            self.state_label.setText("No model loaded")

    def _eject(self):
        if self.chat.generating:
            self.chat.stop()
        self.server.turn_off()
        self.ctl.unload()
        self.state_label.setText("No model loaded")
        self.eject_button.hide()

    def _use_remote(self, backend):
        self.ctl.connect_remote(backend)
        self.show_page("Chat")

    def _on_reply(self, mid):
        m = self.store.get_message(mid)
        if m is not None:
            self.monitor.note_output(m.conversation_id, m.content)

    # ----- server -----
    def _switch_toggled(self, on):
        if self.server.switch.isChecked() != on:
            self.server.switch.setChecked(on)

    def _server_state(self, on):
        if self.server_switch.isChecked() != on:
            self.server_switch.blockSignals(True)
            self.server_switch.setChecked(on)
            self.server_switch.blockSignals(False)
        if not on and self.server.status.text() != "Off.":
            self.statusBar().showMessage(self.server.status.text(), 10000)

    def closeEvent(self, e):
        if self.chat.generating:
            self.chat.stop()
        self.server.shutdown()
        self.ctl.shutdown()
        super().closeEvent(e)
