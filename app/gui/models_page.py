"""Models page: the library on disk (load, plan, delete, import, choose the folder), Hugging Face search
with each GGUF file's quant, size and a "fits" badge from the planner, and the downloads list (speed,
ETA, pause, resume, cancel). Hub calls run in worker threads; results come back as signals."""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QListWidget, QListWidgetItem,
                               QMessageBox, QProgressBar, QPushButton, QSplitter, QTableWidget, QTableWidgetItem,
                               QTabWidget, QVBoxLayout, QWidget)

from app import downloads as D
from engine import planner as P


def _size(n: int) -> str:
    return P.fmt_bytes(n)


def suggested_models() -> list[dict]:
    """resources/suggested_models.json's models (largest first); [] when the file is missing or broken."""
    import json

    from app.gui.theme import RESOURCES
    try:
        return list(json.loads((RESOURCES / "suggested_models.json").read_text())["models"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


class _Bridge(QObject):
    searchDone = Signal(object, str)        # hits, error
    filesDone = Signal(str, object, str)    # repo, files, error
    changed = Signal(object)                # Download


def fits_badge(size_bytes: int, vram: int | None, cpu_mode: bool) -> tuple[str, bool | None]:
    """A quick 'fits' answer for a file not yet on disk: weights (~ file size) + 8K f16-free allowance.
    Files on disk get the exact planner numbers."""
    if vram is None:
        return ("CPU mode", None) if cpu_mode else ("?", None)
    need = size_bytes + P.CUDA_CONTEXT_BYTES + P.CUDA_GRAPH_BYTES + (1 << 30)
    return ("fits" if need <= vram else "too big"), need <= vram


class ModelsPage(QWidget):
    loadRequested = Signal(str)
    planRequested = Signal(str)
    libraryChanged = Signal()
    folderChanged = Signal(str)

    def __init__(self, store, vram_getter=None, parent=None):
        super().__init__(parent)
        self.setObjectName("Page")
        self.store = store
        self.vram_getter = vram_getter or (lambda: (None, True))
        self.bridge = _Bridge()
        self.bridge.searchDone.connect(self._on_search)
        self.bridge.filesDone.connect(self._on_files)
        self.bridge.changed.connect(self._on_download_change)
        from engine.catalog import models_dir
        self.manager = D.DownloadManager(models_dir(), D.HubClient(), on_change=self.bridge.changed.emit)
        self.library: list[D.LocalModel] = []
        self.hub_files: list[D.HubFile] = []
        self.dl_rows: dict[str, int] = {}
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        h = QLabel("Models")
        h.setObjectName("H1")
        lay.addWidget(h)
        self.tabs = QTabWidget()
        lay.addWidget(self.tabs, 1)
        self._build_library()
        self._build_hub()
        self._build_downloads()
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setObjectName("ErrorText")
        lay.addWidget(self.message)
        for d in self.manager.restore():
            self._on_download_change(d)
        self.refresh_library()

    # ----- library -----
    def _build_library(self):
        w = QWidget()
        l = QVBoxLayout(w)
        top = QHBoxLayout()
        self.folder_label = QLabel()
        self.folder_label.setObjectName("Muted")
        top.addWidget(self.folder_label, 1)
        b = QPushButton("Choose folder…")
        b.clicked.connect(self._choose_folder)
        top.addWidget(b)
        b = QPushButton("Import GGUF…")
        b.clicked.connect(self._import_dialog)
        top.addWidget(b)
        b = QPushButton("Refresh")
        b.clicked.connect(self.refresh_library)
        top.addWidget(b)
        l.addLayout(top)
        self.lib_table = QTableWidget(0, 7)
        self.lib_table.setHorizontalHeaderLabels(["Model", "Architecture", "Quant", "Size", "Context", "Pairs", "Status"])
        self.lib_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.lib_table.setSelectionBehavior(QTableWidget.SelectRows)
        self.lib_table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.lib_table.verticalHeader().hide()
        self.lib_table.setAlternatingRowColors(True)
        self.lib_table.cellDoubleClicked.connect(lambda r, c: self._load_row(r))
        l.addWidget(self.lib_table, 1)
        row = QHBoxLayout()
        row.addStretch(1)
        for name, fn in (("Plan memory", self._plan_selected), ("Delete", self._delete_selected),
                         ("Load", self._load_selected)):
            b = QPushButton(name)
            if name == "Load":
                b.setObjectName("Primary")
            if name == "Delete":
                b.setObjectName("Danger")
            b.clicked.connect(fn)
            row.addWidget(b)
        l.addLayout(row)
        self.tabs.addTab(w, "On this computer")

    def refresh_library(self):
        from engine.catalog import models_dir
        root = models_dir()
        self.manager.root = root
        self.folder_label.setText(f"Models folder: {root}   ·   {_size(shutil.disk_usage(root).free)} free")
        self.library = D.scan_library(root)
        self.lib_table.setRowCount(len(self.library))
        for r, m in enumerate(self.library):
            pairs = []
            if m.mmproj:
                pairs.append("vision: " + m.mmproj.name)
            if m.drafter:
                pairs.append("drafter: " + m.drafter.name)
            status = ("damaged: " + m.error) if m.error else {"mmproj": "vision projector",
                                                              "drafter": "draft model"}.get(m.kind, "ready")
            vals = [m.name, m.arch, m.quant, _size(m.size), f"{m.context_length:,}" if m.context_length else "",
                    ", ".join(pairs), status]
            for c, v in enumerate(vals):
                it = QTableWidgetItem(v)
                it.setToolTip(str(m.path))
                self.lib_table.setItem(r, c, it)
        self.libraryChanged.emit()

    def loadable(self) -> list[D.LocalModel]:
        return [m for m in self.library if m.kind == "model" and not m.error]

    def _selected(self) -> D.LocalModel | None:
        r = self.lib_table.currentRow()
        return self.library[r] if 0 <= r < len(self.library) else None

    def _load_row(self, r):
        if 0 <= r < len(self.library):
            m = self.library[r]
            if m.error:
                self.message.setText(f"{m.path.name} cannot be loaded: {m.error}")
            elif m.kind != "model":
                self.message.setText(f"{m.path.name} is a {m.kind} file; it is used together with a model.")
            else:
                self.loadRequested.emit(str(m.path))

    def _load_selected(self):
        self._load_row(self.lib_table.currentRow())

    def _plan_selected(self):
        m = self._selected()
        if m:
            self.planRequested.emit(str(m.path))

    def _delete_selected(self, confirm: bool = True):
        m = self._selected()
        if m is None:
            return
        if confirm and QMessageBox.question(self, "Delete model", f"Delete {m.path.name} ({_size(m.size)}) from disk?"
                                            ) != QMessageBox.Yes:
            return
        self.delete_model(m.path)

    def delete_model(self, path: Path):
        try:
            Path(path).unlink()
        except OSError as e:
            self.message.setText(f"Cannot delete {path}: {e.strerror or e}")
        self.refresh_library()

    def _import_dialog(self):
        path, _ = QFileDialog.getOpenFileName(self, "Import a GGUF model", str(Path.home()), "GGUF models (*.gguf)")
        if path:
            self.import_model(path)

    def import_model(self, path: str) -> bool:
        """Copy a GGUF file into the models folder after checking its header."""
        from engine.catalog import models_dir
        from engine.gguf.reader import GGUFError, GGUFFile
        src = Path(path)
        try:
            GGUFFile(src).close()
        except GGUFError as e:
            self.message.setText(f"Not imported: {e.problem} ({src.name})")
            return False
        dest = models_dir() / "imported" / src.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest.parent).free
        if src.stat().st_size + D.DISK_MARGIN > free:
            self.message.setText(f"Not imported: {src.name} needs {_size(src.stat().st_size)}, "
                                 f"only {_size(free)} free in {dest.parent}")
            return False
        try:
            shutil.copyfile(src, dest)
        except OSError as e:
            self.message.setText(f"Not imported: {e.strerror or e}")
            return False
        self.message.clear()
        self.refresh_library()
        return True

    def _choose_folder(self):
        from engine.catalog import models_dir
        d = QFileDialog.getExistingDirectory(self, "Models folder", str(models_dir()))
        if d:
            self.set_folder(d)

    def set_folder(self, d: str):
        os.environ["HIVEJET_MODELS"] = d
        self.store.set_setting("models_dir", d)
        self.refresh_library()
        self.folderChanged.emit(d)

    # ----- hub -----
    def _build_hub(self):
        w = QWidget()
        l = QVBoxLayout(w)
        top = QHBoxLayout()
        self.search_edit = QLineEdit(placeholderText="Search Hugging Face for GGUF models, e.g. Qwen3.6 27B")
        self.search_edit.returnPressed.connect(self.search)
        top.addWidget(self.search_edit, 1)
        b = QPushButton("Search")
        b.setObjectName("Primary")
        b.clicked.connect(self.search)
        top.addWidget(b)
        l.addLayout(top)
        self.hub_status = QLabel("Search the Hub for GGUF repositories. Works with HF_ENDPOINT mirrors too.")
        self.hub_status.setObjectName("Muted")
        self.hub_status.setWordWrap(True)
        l.addWidget(self.hub_status)
        split = QSplitter(Qt.Horizontal)
        self.repo_list = QListWidget()
        self.repo_list.currentItemChanged.connect(self._on_repo)
        split.addWidget(self.repo_list)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        self.file_table = QTableWidget(0, 5)
        self.file_table.setHorizontalHeaderLabels(["File", "Kind", "Quant", "Size", "Fits this GPU"])
        self.file_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.file_table.setSelectionBehavior(QTableWidget.SelectRows)
        self.file_table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.file_table.verticalHeader().hide()
        self.file_table.cellDoubleClicked.connect(lambda r, c: self.download_row(r))
        rl.addWidget(self.file_table, 1)
        row = QHBoxLayout()
        self.pair_note = QLabel()
        self.pair_note.setObjectName("Muted")
        self.pair_note.setWordWrap(True)
        row.addWidget(self.pair_note, 1)
        b = QPushButton("Download")
        b.setObjectName("Primary")
        b.clicked.connect(lambda: self.download_row(self.file_table.currentRow()))
        row.addWidget(b)
        rl.addLayout(row)
        split.addWidget(right)
        split.setSizes([300, 700])
        l.addWidget(split, 1)
        self.tabs.addTab(w, "Hugging Face")
        self.show_suggestions()

    def show_suggestions(self):
        """Before any search: the suggested models (resources/suggested_models.json) with a fits badge for
        this computer; picking one searches the Hub for it."""
        vram, cpu = self.vram_getter()
        self._clear_repos()
        for m in suggested_models():
            text, ok = fits_badge(int(m["size_gib"] * (1 << 30)), vram, cpu)
            if vram is None and cpu:
                text = f"CPU mode: needs an NVIDIA GPU with {m['min_vram_gib']} GB"
            it = QListWidgetItem(f"{m['name']}\nabout {m['size_gib']} GB · {text}")
            it.setData(Qt.UserRole, {"suggestion": m["search"]})
            it.setToolTip(f"Search the Hub for {m['search']!r} and pick the {m['file_quant']} file")
            if ok is not None:
                it.setForeground(Qt.darkGreen if ok else Qt.red)
            self.repo_list.addItem(it)
        self.hub_status.setText("Suggested models (fits: file size plus runtime allowance vs this GPU's free "
                                "memory). Pick one to find it on the Hub, or search for any GGUF model.")

    def search(self, query: str | None = None):
        q = self.search_edit.text() if query is None else query
        self.hub_status.setText(f"Searching for {q!r} …")
        client = D.HubClient()
        self.manager.client = client

        def work():
            try:
                self.bridge.searchDone.emit(client.search(q), "")
            except D.HubError as e:
                self.bridge.searchDone.emit([], str(e))
        threading.Thread(target=work, daemon=True).start()

    def _clear_repos(self):
        self.repo_list.blockSignals(True)      # (removing the current row would "pick" the next one)
        self.repo_list.clear()
        self.repo_list.blockSignals(False)

    def _on_search(self, hits, err):
        self._clear_repos()
        self.file_table.setRowCount(0)
        if err:
            self.hub_status.setText(err)
            return
        self.hub_status.setText(f"{len(hits)} GGUF repositories" + ("" if hits else ": try other words"))
        for h in hits:
            it = QListWidgetItem(f"{h.id}\n{h.downloads:,} downloads · {h.likes} likes · {h.updated}")
            it.setData(Qt.UserRole, h.id)
            self.repo_list.addItem(it)

    def _on_repo(self, item, _prev=None):
        if item is None:
            return
        repo = item.data(Qt.UserRole)
        if isinstance(repo, dict):          # a suggestion: search for it
            self.search_edit.setText(repo["suggestion"])
            self.search(repo["suggestion"])
            return
        self.hub_status.setText(f"Listing files of {repo} …")
        client = self.manager.client

        def work():
            try:
                self.bridge.filesDone.emit(repo, client.files(repo), "")
            except D.HubError as e:
                self.bridge.filesDone.emit(repo, [], str(e))
        threading.Thread(target=work, daemon=True).start()

    def _on_files(self, repo, files, err):
        if err:
            self.hub_status.setText(err)
            return
        self.hub_status.setText(f"{repo}: {len(files)} GGUF files")
        self.hub_files = files
        vram, cpu = self.vram_getter()
        self.file_table.setRowCount(len(files))
        for r, f in enumerate(files):
            text, ok = fits_badge(f.size, vram, cpu) if f.kind == "model" else ("-", None)
            vals = [f.path + (f"  (part {f.part[0]}/{f.part[1]})" if f.part else ""), f.kind, f.quant, _size(f.size),
                    text]
            for c, v in enumerate(vals):
                it = QTableWidgetItem(v)
                if c == 4 and ok is not None:
                    it.setForeground(Qt.darkGreen if ok else Qt.red)
                if c == 0 and f.sha256:
                    it.setToolTip(f"sha256 {f.sha256}")
                self.file_table.setItem(r, c, it)
        projs = [f for f in files if f.kind == "mmproj"]
        drafts = [f for f in files if f.kind == "drafter"]
        notes = []
        if projs:
            notes.append(f"Vision: {projs[0].path} is downloaded with the model you pick (images need it).")
        if drafts:
            notes.append(f"Drafter: {drafts[0].path} speeds up generation; it is downloaded alongside.")
        if any(f.part for f in files):
            notes.append("Split GGUF files (-0000N-of-0000M) are downloaded part by part; loading them is not "
                         "supported yet.")
        self.pair_note.setText(" ".join(notes) or "Fits: file size plus runtime allowance vs this GPU's free memory; "
                                                  "the Planner page gives exact numbers per context.")

    def download_row(self, r: int):
        if not 0 <= r < len(self.hub_files):
            self.message.setText("Pick a file first.")
            return
        f = self.hub_files[r]
        self.message.clear()
        out = [self.manager.start(f)]
        if f.kind == "model":   # pair the vision projector and the drafter of the same repo
            for extra in self.hub_files:
                if extra.kind in ("mmproj", "drafter") and not self.manager.dest_for(extra.repo_id, extra.path).exists():
                    out.append(self.manager.start(extra))
        self.tabs.setCurrentIndex(2)
        return out

    # ----- downloads -----
    def _build_downloads(self):
        w = QWidget()
        l = QVBoxLayout(w)
        self.dl_table = QTableWidget(0, 6)
        self.dl_table.setHorizontalHeaderLabels(["File", "Progress", "Speed", "ETA", "Status", ""])
        self.dl_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.dl_table.horizontalHeader().setSectionResizeMode(4, QHeaderView.Stretch)
        self.dl_table.verticalHeader().hide()
        self.dl_table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.dl_table.verticalHeader().setDefaultSectionSize(38)
        l.addWidget(self.dl_table, 1)
        self.dl_empty = QLabel("No downloads. Unfinished downloads are kept and resume after a restart.")
        self.dl_empty.setObjectName("Muted")
        l.addWidget(self.dl_empty)
        self.tabs.addTab(w, "Downloads")

    def _on_download_change(self, d: D.Download):
        key = d.key()
        if key not in self.dl_rows:
            r = self.dl_table.rowCount()
            self.dl_table.insertRow(r)
            self.dl_rows[key] = r
            self.dl_table.setItem(r, 0, QTableWidgetItem(f"{d.repo_id} / {d.filename}"))
            bar = QProgressBar()
            bar.setRange(0, 1000)
            self.dl_table.setCellWidget(r, 1, bar)
            for c in (2, 3, 4):
                self.dl_table.setItem(r, c, QTableWidgetItem(""))
            cell = QWidget()
            bl = QHBoxLayout(cell)
            bl.setContentsMargins(2, 0, 2, 0)
            pb = QPushButton("Pause")
            cb = QPushButton("Cancel")
            pb.clicked.connect(lambda _=False, k=key: self._toggle(k))
            cb.clicked.connect(lambda _=False, k=key: self._cancel(k))
            bl.addWidget(pb)
            bl.addWidget(cb)
            self.dl_table.setCellWidget(r, 5, cell)
            self.dl_table.setColumnWidth(5, 170)
        self.dl_empty.hide()
        r = self.dl_rows[key]
        bar: QProgressBar = self.dl_table.cellWidget(r, 1)
        bar.setValue(int(1000 * d.fraction))
        bar.setFormat(f"{_size(d.done_bytes)} / {_size(d.size)}" if d.size else _size(d.done_bytes))
        bar.setTextVisible(True)
        self.dl_table.item(r, 2).setText(D.fmt_rate(d.speed) if d.state == "downloading" else "")
        self.dl_table.item(r, 3).setText(D.fmt_eta(d.eta) if d.state == "downloading" else "")
        status = {"done": "downloaded and verified" if d.sha256 else "downloaded", "paused": "paused",
                  "queued": "starting…", "downloading": "downloading", "verifying": "verifying…",
                  "cancelled": "cancelled", "failed": d.error}.get(d.state, d.state)
        it = self.dl_table.item(r, 4)
        it.setText(status)
        it.setToolTip(status)
        it.setForeground(Qt.red if d.state == "failed" else self.palette().text().color())
        cell = self.dl_table.cellWidget(r, 5)
        pb, cb = cell.findChildren(QPushButton)
        pb.setText("Pause" if d.active else "Resume")
        pb.setEnabled(d.state not in ("done", "cancelled", "verifying"))
        cb.setEnabled(d.state not in ("done", "cancelled"))
        if d.state == "failed":
            self.message.setText(d.error)
        if d.state == "done":
            self.refresh_library()

    def _toggle(self, key):
        d = self.manager.downloads.get(key)
        if d is None:
            return
        if d.active:
            self.manager.pause(d)
        else:
            self.manager.resume(d)

    def _cancel(self, key):
        d = self.manager.downloads.get(key)
        if d is not None:
            self.manager.cancel(d)

    def download_status(self, key: str) -> str:
        r = self.dl_rows.get(key)
        return self.dl_table.item(r, 4).text() if r is not None else ""
