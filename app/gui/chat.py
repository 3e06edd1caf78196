"""The Chat page: conversation list, the visible branch of a conversation, the composer, and the
conversation's own settings (system prompt, sampling) with a context meter.

Replies stream into the store as they arrive (state 'streaming', flushed every 0.5 s), so a crash keeps
what was produced. Regenerate and edit-and-resend add siblings (branches, see app/store.py); each
message with alternatives shows ‹ n/m › to switch between them.
"""
from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QImage
from PySide6.QtWidgets import (QDoubleSpinBox, QFileDialog, QFormLayout, QFrame, QHBoxLayout, QLabel, QLineEdit,
                               QListWidget, QListWidgetItem, QMenu, QPlainTextEdit, QProgressBar, QPushButton,
                               QScrollArea, QSpinBox, QSplitter, QTextEdit, QToolButton, QVBoxLayout, QWidget)

from app.gui.attachments import image_attachment, load_attachment, message_content
from app.gui.icons import icon, pixmap
from app.gui.message_widget import MessageWidget
from app.reply_stats import reply_stats
from app.store import Message, Store
from engine.sampling import SamplingParams

DEFAULT_SAMPLING = dict(temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, max_tokens=1024,
                        repetition_penalty=1.0, seed=-1)


def sampling_params(d: dict) -> SamplingParams:
    s = {**DEFAULT_SAMPLING, **(d or {})}
    seed = int(s.get("seed", -1))
    return SamplingParams(max_tokens=int(s["max_tokens"]), temperature=float(s["temperature"]),
                          top_p=float(s["top_p"]), top_k=int(s["top_k"]), min_p=float(s["min_p"]),
                          repetition_penalty=float(s["repetition_penalty"]), seed=None if seed < 0 else seed)


class Composer(QTextEdit):
    """Enter sends, Shift+Enter is a new line; pasting an image or files attaches them."""

    sendRequested = Signal()
    attachRequested = Signal(object)   # a path (str) or a QImage

    def __init__(self):
        super().__init__()
        self.setAcceptRichText(False)
        self.setPlaceholderText("Message the model…  (Enter to send, Shift+Enter for a new line; paste or drop files)")
        self.setFixedHeight(84)
        self.setObjectName("Composer")

    def keyPressEvent(self, e):
        if e.key() in (Qt.Key_Return, Qt.Key_Enter) and not e.modifiers() & Qt.ShiftModifier:
            self.sendRequested.emit()
            return
        super().keyPressEvent(e)

    def canInsertFromMimeData(self, md):
        return md.hasImage() or md.hasUrls() or super().canInsertFromMimeData(md)

    def insertFromMimeData(self, md):
        if md.hasImage():
            img = QImage(md.imageData())
            if not img.isNull():
                self.attachRequested.emit(img)
                return
        if md.hasUrls() and all(u.isLocalFile() for u in md.urls()):
            for u in md.urls():
                self.attachRequested.emit(u.toLocalFile())
            return
        super().insertFromMimeData(md)


class ChatPage(QWidget):
    replyFinished = Signal(str)       # assistant message id
    conversationChanged = Signal(str)

    def __init__(self, store: Store, controller, parent=None):
        super().__init__(parent)
        self.setObjectName("Page")
        self.store, self.ctl = store, controller
        self.current_id: str | None = None
        self.pending: list[dict] = []
        self.gen = None
        self.gen_msg: Message | None = None
        self.gen_widget: MessageWidget | None = None
        self._gen_text: list[str] = []
        self._dirty = False
        self._last_flush = 0.0
        self._base_tokens = 0
        self.setAcceptDrops(True)
        self._build()
        self._render_timer = QTimer(self, interval=60, timeout=self._tick)
        self.ctl.loaded.connect(lambda *_: self._update_model_state())
        self.ctl.unloaded.connect(self._update_model_state)
        self.reload_conversations()

    # ----- layout -----
    def _build(self):
        outer = QHBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        split = QSplitter(Qt.Horizontal)
        outer.addWidget(split)
        split.addWidget(self._build_conversation_list())
        split.addWidget(self._build_conversation())
        split.addWidget(self._build_settings_panel())
        split.setSizes([230, 800, 260])
        split.setStretchFactor(1, 1)
        self._loading_settings = False
        self._show_settings(*self._defaults())   # before any conversation: the values a new one gets

    def _build_conversation_list(self) -> QWidget:
        """New chat, search, the conversations."""
        side = QWidget()
        side.setObjectName("SidePanel")
        sl = QVBoxLayout(side)
        sl.setContentsMargins(8, 10, 8, 8)
        self.new_button = QPushButton("+  New chat")
        self.new_button.setObjectName("Primary")
        self.new_button.clicked.connect(lambda: self.new_conversation())
        sl.addWidget(self.new_button)
        self.search = QLineEdit(placeholderText="Search chats")
        self.search.textChanged.connect(self.reload_conversations)
        sl.addWidget(self.search)
        self.conv_list = QListWidget()
        self.conv_list.setObjectName("ConvList")
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.conv_list.setTextElideMode(Qt.ElideRight)
        self.conv_list.currentItemChanged.connect(self._on_conv_selected)
        self.conv_list.setContextMenuPolicy(Qt.CustomContextMenu)
        self.conv_list.customContextMenuRequested.connect(self._conv_menu)
        sl.addWidget(self.conv_list, 1)
        side.setMinimumWidth(200)
        return side

    def _build_conversation(self) -> QWidget:
        """Title, banners, the messages, attachments, the composer and its row of actions."""
        center = QWidget()
        cl = QVBoxLayout(center)
        cl.setContentsMargins(16, 10, 16, 12)
        self.title = QLabel("New chat")
        self.title.setObjectName("H2")
        cl.addWidget(self.title)
        self.banner = QLabel()
        self.banner.setObjectName("InfoBanner")
        self.banner.setWordWrap(True)
        self.banner.hide()
        cl.addWidget(self.banner)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.msg_host = QWidget()
        self.msg_layout = QVBoxLayout(self.msg_host)
        self.msg_layout.setContentsMargins(4, 4, 12, 4)
        self.msg_layout.setSpacing(10)
        self.msg_layout.addStretch(1)
        self.scroll.setWidget(self.msg_host)
        cl.addWidget(self.scroll, 1)
        self.empty = QLabel("Start a conversation: type a message below.\nAttach text files or images with Attach, "
                            "by dropping them here, or by pasting.")
        self.empty.setAlignment(Qt.AlignCenter)
        self.empty.setObjectName("Muted")
        self.msg_layout.insertWidget(0, self.empty)
        self.vision_note = QLabel()
        self.vision_note.setObjectName("Banner")
        self.vision_note.setWordWrap(True)
        self.vision_note.hide()
        cl.addWidget(self.vision_note)
        self.attach_row = QHBoxLayout()
        self.attach_row.addStretch(1)
        cl.addLayout(self.attach_row)
        self.composer = Composer()
        self.composer.sendRequested.connect(lambda: self.send())
        self.composer.attachRequested.connect(self._attach_any)
        cl.addWidget(self.composer)
        cl.addLayout(self._build_action_row())
        return center

    def _build_action_row(self) -> QHBoxLayout:
        """Attach, the context meter, errors, Stop and Send."""
        row = QHBoxLayout()
        self.attach_button = QPushButton(icon("attach"), "Attach")
        self.attach_button.clicked.connect(self._attach_dialog)
        row.addWidget(self.attach_button)
        self.context_bar = QProgressBar()
        self.context_bar.setTextVisible(False)
        self.context_bar.setFixedWidth(180)
        self.context_bar.setFixedHeight(10)
        self.context_label = QLabel("context: -")
        self.context_label.setObjectName("Muted")
        row.addWidget(self.context_bar)
        row.addWidget(self.context_label)
        row.addStretch(1)
        self.error_label = QLabel()
        self.error_label.setObjectName("ErrorText")
        self.error_label.setWordWrap(True)
        row.addWidget(self.error_label, 2)
        self.stop_button = QPushButton(icon("stop"), "Stop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        row.addWidget(self.stop_button)
        self.send_button = QPushButton(icon("send", "#ffffff", None), "Send")
        self.send_button.setObjectName("Primary")
        self.send_button.clicked.connect(lambda: self.send())
        row.addWidget(self.send_button)
        return row

    def _build_settings_panel(self) -> QWidget:
        """This conversation's system prompt and sampling settings."""
        right = QWidget()
        right.setObjectName("RightPanel")
        rl = QVBoxLayout(right)
        rl.setContentsMargins(12, 12, 12, 12)
        h = QLabel("This conversation")
        h.setObjectName("H2")
        rl.addWidget(h)
        rl.addWidget(QLabel("System prompt"))
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("e.g. You are a concise senior Python reviewer.")
        self.system_edit.setFixedHeight(110)
        rl.addWidget(self.system_edit)
        form = QFormLayout()
        self.s_temp = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.05, decimals=2)
        self.s_top_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.01, decimals=2)
        self.s_top_k = QSpinBox(minimum=0, maximum=1000)
        self.s_min_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.01, decimals=2)
        self.s_max = QSpinBox(minimum=1, maximum=262144)
        self.s_rep = QDoubleSpinBox(minimum=0.5, maximum=2.0, singleStep=0.05, decimals=2)
        self.s_seed = QSpinBox(minimum=-1, maximum=2**31 - 1)
        self.s_seed.setSpecialValueText("random")
        for lab, w in (("Temperature", self.s_temp), ("Top-p", self.s_top_p), ("Top-k", self.s_top_k),
                       ("Min-p", self.s_min_p), ("Max tokens", self.s_max), ("Repeat penalty", self.s_rep),
                       ("Seed", self.s_seed)):
            form.addRow(lab, w)
            (w.valueChanged).connect(self._save_settings)
        rl.addLayout(form)
        self.system_edit.textChanged.connect(self._save_settings)
        note = QLabel("Saved with the conversation. Temperature 0 = always the most likely token.")
        note.setWordWrap(True)
        note.setObjectName("Muted")
        rl.addWidget(note)
        rl.addStretch(1)
        right.setMinimumWidth(230)
        return right

    # ----- conversations -----
    def reload_conversations(self, *_):
        q = self.search.text().strip().lower()
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        for c in self.store.list_conversations():
            if q and q not in c.title.lower():
                continue
            it = QListWidgetItem(c.title)
            it.setData(Qt.UserRole, c.id)
            it.setToolTip(time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated)))
            self.conv_list.addItem(it)
            if c.id == self.current_id:
                self.conv_list.setCurrentItem(it)
        self.conv_list.blockSignals(False)

    def _on_conv_selected(self, item, _prev=None):
        if item is not None:
            self.open_conversation(item.data(Qt.UserRole))

    def _conv_menu(self, pos):
        it = self.conv_list.itemAt(pos)
        if it is None:
            return
        cid = it.data(Qt.UserRole)
        menu = QMenu(self)
        ren = menu.addAction("Rename")
        dele = menu.addAction("Delete")
        act = menu.exec(self.conv_list.mapToGlobal(pos))
        if act == dele:
            self.delete_conversation(cid)
        elif act == ren:
            self.conv_list.openPersistentEditor(it)
            ed = self.conv_list.itemWidget(it)
            if isinstance(ed, QLineEdit):
                ed.editingFinished.connect(lambda: self._rename(cid, it, ed.text()))

    def _rename(self, cid, it, text):
        self.conv_list.closePersistentEditor(it)
        if text.strip():
            self.store.update_conversation(cid, title=text.strip())
        self.reload_conversations()

    def new_conversation(self) -> str:
        """A new conversation with Settings' defaults, or with what was set in the panel while no
        conversation was open."""
        if self.current_id is None and self._draft_edited:
            system_prompt, sampling = self.system_edit.toPlainText(), self.sampling_dict()
        else:
            system_prompt, sampling = self._defaults()
        c = self.store.create_conversation(sampling=dict(sampling), system_prompt=system_prompt)
        self.current_id = c.id
        self.reload_conversations()
        self.open_conversation(c.id)
        return c.id

    def delete_conversation(self, cid: str):
        if self.gen is not None and self.gen_msg and self.gen_msg.conversation_id == cid:
            self.stop()
        self.store.delete_conversation(cid)
        if cid == self.current_id:
            self.current_id = None
            convs = self.store.list_conversations()
            if convs:
                self.open_conversation(convs[0].id)
            else:
                self._clear_messages()
                self.title.setText("New chat")
                self._show_settings(*self._defaults())
        self.reload_conversations()

    def open_conversation(self, cid: str):
        c = self.store.get_conversation(cid)
        if c is None:
            return
        self.current_id = cid
        self._show_settings(c.system_prompt, c.sampling)
        self.title.setText(c.title)
        self.rebuild_messages()
        self.conversationChanged.emit(cid)

    def _defaults(self) -> tuple[str, dict]:
        """A new conversation's system prompt and sampling: Settings' defaults over DEFAULT_SAMPLING."""
        return (self.store.get_setting("default_system_prompt", ""),
                {**DEFAULT_SAMPLING, **(self.store.get_setting("default_sampling", DEFAULT_SAMPLING) or {})})

    def _show_settings(self, system_prompt: str, sampling: dict):
        self._loading_settings = True
        s = {**DEFAULT_SAMPLING, **(sampling or {})}
        self.system_edit.setPlainText(system_prompt)
        self.s_temp.setValue(float(s["temperature"]))
        self.s_top_p.setValue(float(s["top_p"]))
        self.s_top_k.setValue(int(s["top_k"]))
        self.s_min_p.setValue(float(s["min_p"]))
        self.s_max.setValue(int(s["max_tokens"]))
        self.s_rep.setValue(float(s["repetition_penalty"]))
        self.s_seed.setValue(int(s.get("seed", -1)))
        self._loading_settings = False
        self._draft_edited = False

    def _save_settings(self, *_):
        if self._loading_settings:
            return
        if not self.current_id:     # no conversation yet: the panel's values go to the one the next message starts
            self._draft_edited = True
            return
        self.store.update_conversation(self.current_id, system_prompt=self.system_edit.toPlainText(),
                                       sampling=self.sampling_dict())
        self.update_context_meter()

    def sampling_dict(self) -> dict:
        return dict(temperature=self.s_temp.value(), top_p=self.s_top_p.value(), top_k=self.s_top_k.value(),
                    min_p=self.s_min_p.value(), max_tokens=self.s_max.value(), repetition_penalty=self.s_rep.value(),
                    seed=self.s_seed.value())

    # ----- messages -----
    def _clear_messages(self):
        while self.msg_layout.count() > 2:
            w = self.msg_layout.takeAt(1).widget()
            if w is not None:
                w.deleteLater()
        self.empty.show()

    def message_widgets(self) -> list[MessageWidget]:
        out = []
        for i in range(self.msg_layout.count()):
            w = self.msg_layout.itemAt(i).widget()
            if isinstance(w, MessageWidget):
                out.append(w)
        return out

    def rebuild_messages(self):
        self._clear_messages()
        self.gen_widget = None
        if not self.current_id:
            return
        thread = self.store.thread(self.current_id)
        self.empty.setVisible(not thread)
        for m in thread:
            sibs = self.store.siblings(m.id)
            ids = [s.id for s in sibs]
            w = MessageWidget(self, m, len(sibs), ids.index(m.id))
            self.msg_layout.insertWidget(self.msg_layout.count() - 1, w)
            if self.gen_msg is not None and m.id == self.gen_msg.id and self.gen is not None:
                self.gen_widget = w
                w.message = self.gen_msg
                w.render("".join(self._gen_text), streaming=True)
        self._update_buttons()
        self.update_context_meter()
        QTimer.singleShot(0, self._scroll_to_end)

    def _scroll_to_end(self):
        sb = self.scroll.verticalScrollBar()
        sb.setValue(sb.maximum())

    def show_sibling(self, mid: str, step: int):
        sibs = self.store.siblings(mid)
        ids = [s.id for s in sibs]
        j = ids.index(mid) + step
        if 0 <= j < len(ids):
            self.store.switch_branch(ids[j])
            self.rebuild_messages()

    def delete_message(self, mid: str):
        if self.gen is not None:
            self.error_label.setText("Stop the reply first, then delete.")
            return
        self.store.delete_message(mid)
        self.rebuild_messages()
        self.reload_conversations()

    # ----- attachments -----
    def _attach_dialog(self):
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach files", str(Path.home()),
                                                "Text and images (*.txt *.md *.py *.json *.csv *.log *.yaml *.yml "
                                                "*.toml *.c *.cpp *.h *.rs *.go *.js *.ts *.html *.css *.sh "
                                                "*.png *.jpg *.jpeg *.gif *.bmp *.webp);;All files (*)")
        for p in paths:
            self.attach_file(p)

    def _attach_any(self, x):
        if isinstance(x, QImage):
            self.attach_image(x)
        else:
            self.attach_file(x)

    def attach_file(self, path) -> bool:
        try:
            a = load_attachment(path)
        except (ValueError, OSError) as e:
            self.error_label.setText(str(e))
            return False
        self._add_pending(a)
        return True

    def attach_image(self, img: QImage, name: str = "pasted image.png"):
        self._add_pending(image_attachment(img, name))

    def _add_pending(self, a: dict):
        self.error_label.clear()
        self.pending.append(a)
        self._refresh_pending()

    def _refresh_pending(self):
        while self.attach_row.count() > 1:
            w = self.attach_row.takeAt(0).widget()
            if w is not None:
                w.deleteLater()
        for i, a in enumerate(self.pending):
            chip = QFrame()
            chip.setObjectName("AttachChip")
            cl = QHBoxLayout(chip)
            cl.setContentsMargins(6, 2, 2, 2)
            kind = QLabel()
            kind.setPixmap(pixmap("image" if a["kind"] == "image" else "file", 16))
            cl.addWidget(kind)
            cl.addWidget(QLabel(a["name"]))
            rm = QToolButton()
            rm.setIcon(icon("close"))
            rm.setAutoRaise(True)
            rm.setToolTip("Remove this attachment")
            rm.clicked.connect(lambda _=False, i=i: self._remove_pending(i))
            cl.addWidget(rm)
            self.attach_row.insertWidget(self.attach_row.count() - 1, chip)
        self._update_vision_note()

    def _remove_pending(self, i):
        if 0 <= i < len(self.pending):
            self.pending.pop(i)
        self._refresh_pending()

    def _no_vision_reason(self) -> str | None:
        """Why the loaded model cannot take images (None when it can)."""
        info = self.ctl.info
        if info and info.vision and self.ctl.engine is not None:
            return None
        reason = (info.vision_note if info and info.vision_note else
                  f"{info.name if info else 'No model'} cannot see images: it has no vision projector (mmproj)")
        return reason[:1].upper() + reason[1:]

    def _update_vision_note(self):
        reason = self._no_vision_reason() if any(a["kind"] == "image" for a in self.pending) else None
        if reason:
            self.vision_note.setText(f"{reason}. A message with an image is not sent to it: remove the image "
                                     "to send the text, or load a vision model with its mmproj file beside it.")
            self.vision_note.show()
        else:
            self.vision_note.hide()

    def _refuse_images(self, attachments: list[dict]) -> bool:
        """True (with a message; the typed text and attachments stay) when `attachments` hold an image the
        loaded model cannot see, as the API server refuses such a request."""
        reason = self._no_vision_reason() if any(a.get("kind") == "image" for a in attachments) else None
        if reason:
            self.error_label.setText(f"Not sent: {reason}. Remove the image, or load a vision model.")
            self._update_vision_note()
        return bool(reason)

    def dragEnterEvent(self, e):
        if e.mimeData().hasUrls() or e.mimeData().hasImage():
            e.acceptProposedAction()

    def dropEvent(self, e):
        md = e.mimeData()
        if md.hasImage():
            self.attach_image(QImage(md.imageData()), "dropped image.png")
        for u in md.urls():
            if u.isLocalFile():
                self.attach_file(u.toLocalFile())
        e.acceptProposedAction()

    # ----- generation -----
    @property
    def generating(self) -> bool:
        return self.gen is not None

    def _update_buttons(self):
        busy = self.gen is not None
        self.stop_button.setEnabled(busy)
        self.send_button.setEnabled(not busy)
        for w in self.message_widgets():
            for name in ("Regenerate", "Edit", "Delete"):
                if name in w.buttons:
                    w.buttons[name].setEnabled(not busy)

    def _update_model_state(self):
        self._update_vision_note()
        self.update_context_meter()

    def model_messages(self, thread: list[Message]) -> list[dict]:
        c = self.store.get_conversation(self.current_id)
        msgs = []
        if c and c.system_prompt.strip():
            msgs.append({"role": "system", "content": c.system_prompt})
        images = bool(self.ctl.info and self.ctl.info.vision and self.ctl.engine is not None)
        for m in thread:
            if m.role in ("user", "assistant") and (m.role == "user" or m.state != "error"):
                msgs.append({"role": m.role, "content": message_content(m, images and m.role == "user")})
        return msgs

    def send(self, text: str | None = None) -> bool:
        if self.gen is not None:
            return False
        text = self.composer.toPlainText() if text is None else text
        if not text.strip() and not self.pending:
            return False
        if not self.ctl.ready:
            self.error_label.setText("No model is loaded yet: pick one in the model menu at the top.")
            return False
        if self._refuse_images(self.pending):
            return False
        if not self.current_id:
            self.new_conversation()
        c = self.store.get_conversation(self.current_id)
        thread = self.store.thread(self.current_id)
        parent = thread[-1].id if thread else None
        u = self.store.add_message(self.current_id, "user", text.strip(), parent, attachments=self.pending)
        if c.title == "New chat":
            self.store.update_conversation(self.current_id, title=(text.strip().splitlines() or ["Attachment"])[0][:48])
            self.title.setText(self.store.get_conversation(self.current_id).title)
        self.pending = []
        self._refresh_pending()
        self.composer.clear()
        self.reload_conversations()
        return self._start_reply(u.id)

    def regenerate(self, mid: str | None = None) -> bool:
        """A new reply to the same user message, kept as a sibling of the old one."""
        if self.gen is not None or not self.current_id:
            return False
        thread = self.store.thread(self.current_id)
        if mid is None:
            mid = next((m.id for m in reversed(thread) if m.role == "assistant"), None)
        m = self.store.get_message(mid) if mid else None
        if m is None or m.role != "assistant" or m.parent_id is None:
            return False
        asked = self.store.get_message(m.parent_id)
        if asked is not None and self._refuse_images(asked.attachments):
            return False
        return self._start_reply(m.parent_id)

    def edit_and_resend(self, mid: str, new_text: str) -> bool:
        """The edited message becomes a sibling of the original (both stay reachable)."""
        if self.gen is not None:
            return False
        m = self.store.get_message(mid)
        if m is None or m.role != "user" or not new_text.strip():
            return False
        if self._refuse_images(m.attachments):
            return False
        u = self.store.add_message(m.conversation_id, "user", new_text.strip(), m.parent_id, attachments=m.attachments)
        return self._start_reply(u.id)

    def _start_reply(self, user_id: str) -> bool:
        self.error_label.clear()
        c = self.store.get_conversation(self.current_id)
        thread = self.store.thread(self.current_id, user_id)
        msgs = self.model_messages(thread)
        model_name = self.ctl.info.name if self.ctl.info else ""
        a = self.store.add_message(self.current_id, "assistant", "", user_id, state="streaming",
                                   meta={"model": model_name})
        try:
            self.gen = self.ctl.generate(msgs, sampling_params(c.sampling), session=self.current_id)
        except Exception as e:   # refused: context too long, bad sampling, no model ...
            self.store.update_message(a.id, state="error", meta={"model": model_name, "error": str(e)})
            self.gen = None
            self.error_label.setText(str(e))
            self.rebuild_messages()
            return False
        self.gen_msg = a
        self._gen_text = []
        self._dirty = True
        self._base_tokens = self.ctl.count_tokens(msgs) or 0
        self._t0 = time.monotonic()
        self.gen.token.connect(self._on_token)
        self.gen.finished.connect(self._on_finished)
        self.rebuild_messages()
        self._render_timer.start()
        return True

    def live_text(self, session: str) -> str | None:
        """The reply being written for conversation `session` (for the Monitor)."""
        if self.gen_msg is not None and self.gen_msg.conversation_id == session:
            return "".join(self._gen_text)
        return None

    def _on_token(self, text: str):
        self._gen_text.append(text)
        self._dirty = True

    def _tick(self):
        if self.gen_msg is None:
            return
        now = time.monotonic()
        text = "".join(self._gen_text)
        if self._dirty and self.gen_widget is not None:
            self._dirty = False
            sb = self.scroll.verticalScrollBar()
            at_end = sb.value() >= sb.maximum() - 40
            self.gen_widget.render(text, streaming=True)
            if at_end:
                QTimer.singleShot(0, self._scroll_to_end)
            if self.gen is not None:
                self._set_meter(self._base_tokens + self.gen.n_tokens)
        if now - self._last_flush > 0.5:
            self._last_flush = now
            self.store.update_message(self.gen_msg.id, content=text)

    def stop(self):
        if self.gen is not None:
            self.gen.cancel()

    def _on_finished(self, fin):
        self._render_timer.stop()
        text = "".join(self._gen_text)
        m = self.gen_msg
        self.gen, self.gen_msg = None, None
        state = {"stop": "complete", "length": "complete", "cancelled": "stopped", "error": "error"}.get(fin.reason,
                                                                                                       "complete")
        n = fin.usage.completion_tokens
        status = reply_stats(fin)        # tokens · tok/s · first token, under the reply
        if fin.reason == "length":
            status += " · hit the max tokens limit"
        meta = dict(m.meta, status=status, finish=fin.reason, tokens=n)
        if fin.error:
            meta["error"] = fin.error
        self.store.update_message(m.id, content=text, state=state, meta=meta)
        if fin.reason == "error":
            self.error_label.setText(f"The reply failed: {fin.error}")
        if m.conversation_id == self.current_id:
            self.rebuild_messages()
        self._update_buttons()
        self.replyFinished.emit(m.id)

    # ----- context meter -----
    def update_context_meter(self):
        if not self.current_id or self.ctl.info is None:
            self.context_bar.setValue(0)
            self.context_label.setText("context: no model loaded" if self.ctl.info is None else "context: 0")
            return
        if self.gen is not None:
            return
        thread = self.store.thread(self.current_id)
        msgs = self.model_messages(thread)
        n = self.ctl.count_tokens(msgs) if msgs else 0
        self._set_meter(n)

    def _set_meter(self, n: int | None):
        info = self.ctl.info
        limit = info.ctx_size if info else 0
        if n is None or not limit:
            self.context_label.setText("context: -")
            return
        self.context_bar.setMaximum(limit)
        self.context_bar.setValue(min(n, limit))
        self.context_label.setText(f"context {n:,} / {limit:,} tokens ({100 * n / limit:.1f}%)")
        self.context_used = n
