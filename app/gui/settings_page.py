"""Settings page: models folder, theme (system / light / dark), CPU threads, speculative decoding, default system prompt,
remote OpenAI-compatible endpoints. Everything persists in the store's settings table."""
from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QPlainTextEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from app.gui.controller import RemoteBackend, RemoteError, list_remote_models


class _Bridge(QObject):
    remoteListed = Signal(str, str, object, str)   # url, key, models, error


class SettingsPage(QWidget):
    themeChanged = Signal(str)
    folderChosen = Signal(str)
    remoteChosen = Signal(object)   # RemoteBackend

    def __init__(self, store, parent=None):
        super().__init__(parent)
        self.setObjectName("Page")
        self.store = store
        self.bridge = _Bridge()
        self.bridge.remoteListed.connect(self._on_remote_listed)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        h = QLabel("Settings")
        h.setObjectName("H1")
        lay.addWidget(h)
        lay.addLayout(self._build_form(store))
        self._build_remotes(lay)
        self.data_note = QLabel()
        self.data_note.setObjectName("Muted")
        lay.addWidget(self.data_note)
        self.data_note.setText(f"Conversations and settings: {store.path}")
        self._fill_remotes()

    def _build_form(self, store) -> QFormLayout:
        """Models folder, theme, the engine's settings, the default system prompt."""
        form = QFormLayout()
        from engine.catalog import models_dir
        frow = QHBoxLayout()
        self.folder = QLineEdit(str(models_dir()))
        self.folder.setReadOnly(True)
        frow.addWidget(self.folder, 1)
        b = QPushButton("Choose…")
        b.clicked.connect(self._choose)
        frow.addWidget(b)
        form.addRow("Models folder", frow)
        self.theme = QComboBox()
        self.theme.addItem("Follow the system", "system")
        self.theme.addItem("Light", "light")
        self.theme.addItem("Dark", "dark")
        self.theme.setCurrentIndex(max(0, self.theme.findData(store.get_setting("theme", "system"))))
        self.theme.currentIndexChanged.connect(self._theme)
        form.addRow("Theme", self.theme)
        self._add_engine_rows(form, store)
        self.sys_prompt = QPlainTextEdit(store.get_setting("default_system_prompt", ""))
        self.sys_prompt.setFixedHeight(70)
        self.sys_prompt.setPlaceholderText("Used for new conversations")
        self.sys_prompt.textChanged.connect(lambda: store.set_setting("default_system_prompt",
                                                                      self.sys_prompt.toPlainText()))
        form.addRow("Default system prompt", self.sys_prompt)
        return form

    def _add_engine_rows(self, form: QFormLayout, store) -> None:
        """The settings the next model load uses: CPU threads, speculative decoding, parallel
        conversations, long-prompt pacing."""
        from engine.engine import default_threads
        self.threads = QSpinBox(minimum=0, maximum=256, value=int(store.get_setting("threads", 0)))
        self.threads.setSpecialValueText(f"automatic ({default_threads()})")
        self.threads.valueChanged.connect(lambda v: store.set_setting("threads", v))
        form.addRow("CPU threads (next load)", self.threads)
        self.spec = QComboBox()
        self.spec.addItem("Off", "off")
        self.spec.addItem("Prompt lookup (n-gram drafts)", "ngram")
        self.spec.addItem("The model's own drafter (MTP, or a DFlash drafter beside it) + prompt lookup", "auto")
        self.spec.setCurrentIndex(max(0, self.spec.findData(store.get_setting("spec", "off"))))
        self.spec.currentIndexChanged.connect(lambda _i: store.set_setting("spec", self.spec.currentData()))
        self.spec.setToolTip("Draft tokens checked by the model in the same step: greedy output stays the same "
                             "and sampled output keeps its distribution, on the CPU and on the GPU.")
        form.addRow("Speculative decoding (next load)", self.spec)
        from app.gui.controller import parallel_conversations
        self.parallel = QSpinBox(minimum=1, maximum=64, value=parallel_conversations(store))
        self.parallel.valueChanged.connect(lambda v: store.set_setting("parallel", v))
        self.parallel.setToolTip("Conversations advanced together: the chat and agents through the local server. "
                                 "Each holds its own state on the GPU (157 MB for a 27B Qwen3.5), so fewer leave "
                                 "more memory to the context; the planner shows both.")
        form.addRow("Parallel conversations (next load)", self.parallel)
        self.pacing = QComboBox()
        self.pacing.addItem("Keep generating conversations at half their speed or more", 0.5)
        self.pacing.addItem("Keep generating conversations at three quarters of their speed", 0.25)
        self.pacing.addItem("Long prompts first (no pacing)", 1.0)
        from app.gui.controller import pacing_share
        self.pacing.setCurrentIndex(max(0, self.pacing.findData(pacing_share(store.get_setting("prefill_share", 0.5)))))
        self.pacing.currentIndexChanged.connect(
            lambda _i: store.set_setting("prefill_share", self.pacing.currentData()))
        self.pacing.setToolTip("On the GPU, while conversations generate (the chat, agents through the local "
                               "server), a long new prompt is read in chunks between their steps: how much of "
                               "their speed it may take. Pacing makes that prompt's first token come later.")
        form.addRow("Long prompts beside generating conversations (next load)", self.pacing)

    def _build_remotes(self, lay: QVBoxLayout) -> None:
        """Remote endpoints: add one (URL, key), the models listed, remove, chat with one."""
        h2 = QLabel("Remote endpoints")
        h2.setObjectName("H2")
        lay.addWidget(h2)
        note = QLabel("Chat with models served elsewhere through an OpenAI-compatible API (another HiveJet, "
                      "llama.cpp server, vLLM, LM Studio, OpenAI).")
        note.setObjectName("Muted")
        note.setWordWrap(True)
        lay.addWidget(note)
        rrow = QHBoxLayout()
        self.r_url = QLineEdit(placeholderText="https://host:port/v1")
        self.r_key = QLineEdit(placeholderText="API key (optional)")
        self.r_key.setEchoMode(QLineEdit.Password)
        b = QPushButton("Add")
        b.clicked.connect(self.add_remote)
        rrow.addWidget(self.r_url, 2)
        rrow.addWidget(self.r_key, 1)
        rrow.addWidget(b)
        lay.addLayout(rrow)
        self.r_status = QLabel()
        self.r_status.setWordWrap(True)
        lay.addWidget(self.r_status)
        self.r_list = QListWidget()
        self.r_list.itemDoubleClicked.connect(self._use_remote)
        lay.addWidget(self.r_list, 1)
        brow = QHBoxLayout()
        brow.addStretch(1)
        b = QPushButton("Remove")
        b.clicked.connect(self._remove_remote)
        brow.addWidget(b)
        b = QPushButton("Chat with this model")
        b.setObjectName("Primary")
        b.clicked.connect(lambda: self._use_remote(self.r_list.currentItem()))
        brow.addWidget(b)
        lay.addLayout(brow)

    def _choose(self):
        d = QFileDialog.getExistingDirectory(self, "Models folder", self.folder.text())
        if d:
            self.set_folder(d)

    def set_folder(self, d: str):
        self.folder.setText(d)
        self.folderChosen.emit(d)

    def _theme(self):
        mode = self.theme.currentData()
        self.store.set_setting("theme", mode)
        self.themeChanged.emit(mode)

    # ----- remotes -----
    def remotes(self) -> list[dict]:
        return list(self.store.get_setting("remotes", []))

    def _fill_remotes(self):
        self.r_list.clear()
        for r in self.remotes():
            for m in r.get("models", []):
                it = QListWidgetItem(f"{m}   ·   {r['url']}")
                it.setData(Qt.UserRole, (r["url"], r.get("key", ""), m))
                self.r_list.addItem(it)

    def add_remote(self, url: str | None = None, key: str | None = None):
        url = (url or self.r_url.text()).strip().rstrip("/")
        key = self.r_key.text().strip() if key is None else key
        if not url.startswith(("http://", "https://")):
            self.r_status.setText("Enter a URL starting with http:// or https:// (usually ending in /v1).")
            return
        self.r_status.setText(f"Asking {url} for its models …")

        def work():
            try:
                self.bridge.remoteListed.emit(url, key, list_remote_models(url, key), "")
            except RemoteError as e:
                self.bridge.remoteListed.emit(url, key, [], str(e))
        threading.Thread(target=work, daemon=True).start()

    def _on_remote_listed(self, url, key, models, err):
        if err:
            self.r_status.setText(err)
            return
        rs = [r for r in self.remotes() if r["url"] != url] + [dict(url=url, key=key, models=models)]
        self.store.set_setting("remotes", rs)
        self.r_status.setText(f"{url}: {len(models)} models")
        self._fill_remotes()

    def _remove_remote(self):
        it = self.r_list.currentItem()
        if it is None:
            return
        url = it.data(Qt.UserRole)[0]
        self.store.set_setting("remotes", [r for r in self.remotes() if r["url"] != url])
        self._fill_remotes()

    def _use_remote(self, it):
        if it is None:
            return
        url, key, model = it.data(Qt.UserRole)
        self.remoteChosen.emit(RemoteBackend(url, model, key))
