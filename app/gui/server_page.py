"""Server page and switch: the local OpenAI-compatible API (app/server's create_app) served in-process
by uvicorn in a thread, on/off, port, "allow other devices on my network" (binds 0.0.0.0 and requires
the generated API key), base URL and model id with copy buttons, editor settings to paste, connected clients
and the recent requests (app/gui/request_log.py)."""
from __future__ import annotations

import json
import secrets
import shlex
import socket
import threading
import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QListWidget, QPlainTextEdit,
                               QPushButton, QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.gui.request_log import RequestLog


def server_factory():
    """app/server's create_app, or None while the server is not part of this build."""
    try:
        from app.server import create_app
        return create_app
    except ImportError:
        pass
    try:
        from app.server.app import create_app
        return create_app
    except ImportError:
        return None


def shell_arg(s: str) -> str:
    """`s` quoted for a command line: in double quotes, which bash, zsh, cmd and PowerShell all read the same
    way, unless it holds characters that are special inside them (then POSIX single quotes)."""
    return f'"{s}"' if not set(s) & set('"$`\\!%') else shlex.quote(s)


def lan_address() -> str:
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("10.255.255.255", 1))
        ip = s.getsockname()[0]
        s.close()
        return ip
    except OSError:
        return "127.0.0.1"


class ServerController:
    def __init__(self):
        self.server = None
        self.thread = None
        self.engine = None      # the engine it serves
        self.host = "127.0.0.1"
        self.port = 0
        self.log = RequestLog()

    @property
    def running(self) -> bool:
        return self.server is not None and self.thread is not None and self.thread.is_alive()

    def start(self, engine, port: int, lan: bool, api_key: str | None) -> str:
        """Returns "" when started, else a message for the user."""
        factory = server_factory()
        if factory is None:
            return ("The local API server is not part of this build yet (app/server has no create_app). "
                    "The switch will work once it lands.")
        if engine is None:
            return "Load a model first: the server shares the model loaded in the app."
        if lan and not api_key:
            return "Allowing other devices needs an API key."
        import uvicorn
        self.host = "0.0.0.0" if lan else "127.0.0.1"
        try:
            from app.server import ServerSettings
            settings = ServerSettings(host=self.host, port=port, api_keys=[api_key] if api_key else [],
                                      accept_any_model=True)
            settings.validate()
            app = factory(engine, settings)
        except ImportError:
            app = factory(engine)
        except Exception as e:   # SettingsError and the like
            return f"The server cannot start: {e}"
        try:
            probe = socket.socket()
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((self.host, port))
            probe.close()
        except OSError as e:
            return f"Port {port} is in use or not allowed ({e.strerror}); choose another port."
        cfg = uvicorn.Config(self.log.attach(app), host=self.host, port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(cfg)
        self.engine = engine
        self.port = port
        self.thread = threading.Thread(target=self.server.run, name="hivejet-server", daemon=True)
        self.thread.start()
        return ""

    def wait_started(self, timeout=10.0) -> bool:
        import time
        t = time.time()
        while time.time() - t < timeout:
            if self.server is not None and self.server.started:
                return True
            if self.thread is not None and not self.thread.is_alive():
                return False
            time.sleep(0.05)
        return False

    def stop(self):
        if self.server is not None:
            self.server.should_exit = True
            if self.thread is not None:
                self.thread.join(5)
        self.server = self.thread = self.engine = None

    def clients(self) -> list[str]:
        if self.server is None:
            return []
        out = []
        for proto in list(getattr(self.server.server_state, "connections", [])):
            c = getattr(proto, "client", None)
            if c:
                out.append(f"{c[0]}:{c[1]}")
        return out


class ServerPage(QWidget):
    stateChanged = Signal(bool)

    def __init__(self, store, controller, parent=None):
        super().__init__(parent)
        self.setObjectName("Page")
        self.store, self.ctl = store, controller
        self.srv = ServerController()
        # the server shares the app's engine: it is off while a model loads (it must not serve an engine
        # being replaced) and back on afterwards on whichever model is then loaded; unloading stops it
        self._resume = False
        self.ctl.loadStarted.connect(self._load_started)
        for sig in (self.ctl.loaded, self.ctl.loadFailed, self.ctl.loadCancelled):
            sig.connect(self._load_ended)
        self.ctl.unloaded.connect(self._model_gone)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        h = QLabel("Local server")
        h.setObjectName("H1")
        lay.addWidget(h)
        intro = QLabel("Expose the loaded model as an OpenAI-compatible API for code editors and agents. "
                       "Several clients can share the model at once.")
        intro.setWordWrap(True)
        intro.setObjectName("Muted")
        lay.addWidget(intro)
        lay.addLayout(self._build_switch_row(store))
        self._build_connection_rows(lay, store)
        self.status = QLabel("Off.")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)
        self._build_activity(lay)
        self._log_version = -1
        self.timer = QTimer(self, interval=1000, timeout=self._refresh_clients)
        self.timer.start()
        self._update_texts()

    def _build_switch_row(self, store) -> QHBoxLayout:
        """Server on, port, allow other devices."""
        row = QHBoxLayout()
        self.switch = QCheckBox("Server on")
        self.switch.setObjectName("Switch")
        self.switch.toggled.connect(self._toggled)
        row.addWidget(self.switch)
        row.addSpacing(24)
        row.addWidget(QLabel("Port"))
        self.port = QSpinBox(minimum=1024, maximum=65535, value=int(store.get_setting("server_port", 8765)))
        self.port.valueChanged.connect(lambda v: store.set_setting("server_port", v))
        row.addWidget(self.port)
        row.addSpacing(24)
        self.lan = QCheckBox("Allow other devices on my network")
        self.lan.setChecked(bool(store.get_setting("server_lan", False)))
        self.lan.toggled.connect(self._lan_toggled)
        row.addWidget(self.lan)
        row.addStretch(1)
        return row

    def _copy_row(self, label: str, edit: QLineEdit) -> QHBoxLayout:
        """label, a read-only field and its Copy button."""
        row = QHBoxLayout()
        row.addWidget(QLabel(label))
        edit.setReadOnly(True)
        row.addWidget(edit, 1)
        b = QPushButton("Copy")
        b.clicked.connect(lambda: self._copy(edit.text()))
        row.addWidget(b)
        return row

    def _build_connection_rows(self, lay: QVBoxLayout, store) -> None:
        """What a client needs: the API key (with New key), the base URL, the model id."""
        self.key = QLineEdit(store.get_setting("server_api_key", "") or "")
        self.key.setPlaceholderText("generated when you allow other devices")
        krow = self._copy_row("API key", self.key)
        b = QPushButton("New key")
        b.clicked.connect(self.new_key)
        krow.addWidget(b)
        lay.addLayout(krow)
        self.url = QLineEdit()
        lay.addLayout(self._copy_row("Base URL", self.url))
        self.model_id = QLineEdit()
        self.model_id.setToolTip("The name clients send as \"model\" (GET /v1/models lists it)")
        lay.addLayout(self._copy_row("Model id", self.model_id))

    def _build_activity(self, lay: QVBoxLayout) -> None:
        """Editor snippets, connected clients, recent requests."""
        lay.addWidget(QLabel("Settings to paste into your editor or agent"))
        self.snippets = QPlainTextEdit()
        self.snippets.setReadOnly(True)
        lay.addWidget(self.snippets, 2)
        b = QPushButton("Copy settings")
        b.clicked.connect(lambda: self._copy(self.snippets.toPlainText()))
        lay.addWidget(b, 0, Qt.AlignRight)
        lay.addWidget(QLabel("Connected clients"))
        self.clients = QListWidget()
        lay.addWidget(self.clients, 1)
        lay.addWidget(QLabel("Recent requests"))
        self.requests = QTableWidget(0, 5)
        self.requests.setHorizontalHeaderLabels(["Time", "Request", "Status", "Tokens", "Duration"])
        self.requests.horizontalHeader().setSectionResizeMode(1, QHeaderView.Stretch)
        self.requests.verticalHeader().hide()
        self.requests.setEditTriggers(QTableWidget.NoEditTriggers)
        lay.addWidget(self.requests, 2)

    def _copy(self, text):
        QGuiApplication.clipboard().setText(text)

    def new_key(self):
        k = "hj-" + secrets.token_urlsafe(24)
        self.key.setText(k)
        self.store.set_setting("server_api_key", k)
        self._update_texts()
        return k

    def _lan_toggled(self, on):
        self.store.set_setting("server_lan", on)
        if on and not self.key.text():
            self.new_key()
        if self.srv.running:   # restart with the new binding
            self.switch.setChecked(False)
            self.switch.setChecked(True)
        self._update_texts()

    def base_url(self) -> str:
        host = lan_address() if self.lan.isChecked() else "127.0.0.1"
        return f"http://{host}:{self.port.value()}/v1"

    def api_model_id(self) -> str:
        """The id the server reports for the loaded model (app/server's model_id: the file name without .gguf),
        which is what clients must send; the display name can differ from it."""
        info = self.ctl.info
        if info is None or info.remote or not info.path:
            return "local-model"
        return Path(info.path).stem

    def _update_texts(self):
        self.url.setText(self.base_url())
        key = self.key.text() if self.lan.isChecked() else (self.key.text() or "not-needed")
        model = self.api_model_id()
        self.model_id.setText(model)
        self.snippets.setPlainText(
            f"# OpenAI-compatible clients\nOPENAI_BASE_URL={self.base_url()}\nOPENAI_API_KEY={key}\n"
            f"# model id: {model}\n\n"
            f"# Continue (config.yaml)\nmodels:\n  - name: HiveJet\n    provider: openai\n    model: {json.dumps(model)}\n"
            f"    apiBase: {self.base_url()}\n    apiKey: {key}\n\n"
            f"# Aider\naider --openai-api-base {self.base_url()} --openai-api-key {shlex.quote(key)} "
            f"--model {shell_arg('openai/' + model)}\n\n"
            f"# Python\nfrom openai import OpenAI\nclient = OpenAI(base_url=\"{self.base_url()}\", api_key=\"{key}\")\n"
            f"reply = client.chat.completions.create(model={json.dumps(model)}, messages=[{{\"role\": \"user\", "
            f"\"content\": \"Hello\"}}])\n")

    def _toggled(self, on):
        if on:
            if self.lan.isChecked() and not self.key.text():
                self.new_key()
            msg = self.srv.start(self.ctl.engine, self.port.value(), self.lan.isChecked(),
                                 self.key.text() if self.lan.isChecked() else None)
            if msg:
                self.status.setText(msg)
                self.status.setObjectName("ErrorText")
                self.status.style().polish(self.status)
                self.switch.blockSignals(True)
                self.switch.setChecked(False)
                self.switch.blockSignals(False)
                self.stateChanged.emit(False)
                return
            self.status.setObjectName("")
            self.status.style().polish(self.status)
            self.status.setText(f"Running on {self.srv.host}:{self.srv.port}"
                                + (" (reachable from your network; clients need the API key)" if self.lan.isChecked()
                                   else " (this computer only)"))
        else:
            self.srv.stop()
            self.status.setText("Off.")
        self._update_texts()
        self.stateChanged.emit(on)

    def _load_started(self, _model=None):
        if self.srv.running:
            self._resume = True
            self.switch.setChecked(False)

    def _load_ended(self, *_):
        if self.srv.running and self.srv.engine is not self.ctl.engine:   # (a load that did not pause it)
            self.switch.setChecked(False)
            self.switch.setChecked(True)
        elif self._resume and self.ctl.engine is not None:
            self.switch.setChecked(True)
        self._resume = False

    def turn_off(self):
        """Off, and not back on after a load in progress (ejecting the model)."""
        self._resume = False
        self.switch.setChecked(False)

    def _model_gone(self):
        if self.srv.running:
            self.switch.setChecked(False)
            self.status.setText("Stopped: the model it served was unloaded. Turn it on again once a model is loaded.")

    def refresh_requests(self):
        """The request log's newest 100 entries, newest first (time, method and route, status, tokens
        generated (prompt tokens in the tooltip), duration)."""
        log = self.srv.log
        if log.version == self._log_version:
            return
        self._log_version = log.version
        rows = log.recent(100)
        self.requests.setRowCount(len(rows))
        for r, e in enumerate(rows):
            vals = [time.strftime("%H:%M:%S", time.localtime(e["time"])), f"{e['method']} {e['path']}",
                    str(e["status"] or "-"), f"{e['tokens']:,}" if e["tokens"] or e["prompt_tokens"] else "",
                    f"{e['ms'] / 1000:.2f} s" if e["ms"] >= 1000 else f"{e['ms']:.0f} ms"]
            for c, v in enumerate(vals):
                it = QTableWidgetItem(v)
                if c == 3 and e["prompt_tokens"]:
                    it.setToolTip(f"{e['prompt_tokens']:,} prompt tokens, {e['tokens']:,} generated")
                self.requests.setItem(r, c, it)

    def _refresh_clients(self):
        self.refresh_requests()
        cl = self.srv.clients()
        items = [self.clients.item(i).text() for i in range(self.clients.count())]
        if cl != items:
            self.clients.clear()
            self.clients.addItems(cl or [])

    def shutdown(self):
        self.srv.stop()
