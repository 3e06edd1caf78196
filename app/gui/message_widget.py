"""One message of the chat: its role, its text as Markdown (code blocks with a Copy link), attachment chips
and thumbnails, the ‹ n/m › switch between branches, a status line (generating, the reply's figures,
stopped, error) and its actions (Copy, Edit or Regenerate, Delete); editing happens in place."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QApplication, QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QSizePolicy,
                               QTextBrowser, QVBoxLayout, QWidget)

from app.gui.attachments import attachment_pixmap, file_icon_label
from app.gui.markdown_view import render
from app.gui.theme import is_dark
from app.store import Message


class AutoBrowser(QTextBrowser):
    """A QTextBrowser as tall as its content; links `copy:N` copy code block N."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setReadOnly(True)
        self.setFrameShape(QFrame.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.LinksAccessibleByMouse)
        self.blocks: list[str] = []
        self.anchorClicked.connect(self._anchor)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)

    def set_markdown(self, text: str, dark: bool) -> None:
        html, self.blocks = render(text, dark)
        self.setHtml(html)
        self._fit()

    def _anchor(self, url):
        s = url.toString()
        if s.startswith("copy:"):
            i = int(s.split(":", 1)[1])
            if 0 <= i < len(self.blocks):
                QGuiApplication.clipboard().setText(self.blocks[i])
                w = self.window()
                if hasattr(w, "statusBar"):
                    w.statusBar().showMessage("Code copied to the clipboard", 2500)

    def _fit(self, *_):
        self.document().setTextWidth(max(self.viewport().width(), 50))
        self.setFixedHeight(int(self.document().size().height()) + 6)

    def resizeEvent(self, e):
        super().resizeEvent(e)
        self._fit()


class MessageWidget(QFrame):
    """`page` is the ChatPage: it regenerates, edits, deletes and switches branches."""

    def __init__(self, page, m: Message, n_sib: int, i_sib: int):
        super().__init__()
        self.page, self.message = page, m
        self.setObjectName("MsgUser" if m.role == "user" else "MsgAssistant")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 8)
        lay.setSpacing(4)
        role = QLabel("You" if m.role == "user" else (m.meta.get("model") or "Assistant"))
        role.setObjectName("MsgRole")
        lay.addWidget(role)
        self.view = AutoBrowser()
        lay.addWidget(self.view)
        self.editor: QPlainTextEdit | None = None
        if m.attachments:
            row = QHBoxLayout()
            for a in m.attachments:
                chip = QLabel()
                if a.get("kind") == "image":
                    chip.setPixmap(attachment_pixmap(a))
                    chip.setToolTip(f"{a['name']} ({a.get('width')}x{a.get('height')})")
                else:
                    chip.setText(f"{a['name']} · {len(a.get('text', ''))} chars")
                    chip.setObjectName("Muted")
                    row.addWidget(file_icon_label())
                row.addWidget(chip)
            row.addStretch(1)
            lay.addLayout(row)
        bar = QHBoxLayout()
        bar.setSpacing(2)
        self.status = QLabel()
        self.status.setObjectName("MsgStatus")
        if n_sib > 1:
            prev = QPushButton("‹")
            prev.setObjectName("Link")
            nxt = QPushButton("›")
            nxt.setObjectName("Link")
            lab = QLabel(f"{i_sib + 1}/{n_sib}")
            lab.setObjectName("MsgStatus")
            prev.setEnabled(i_sib > 0)
            nxt.setEnabled(i_sib < n_sib - 1)
            prev.clicked.connect(lambda: page.show_sibling(m.id, -1))
            nxt.clicked.connect(lambda: page.show_sibling(m.id, +1))
            bar.addWidget(prev)
            bar.addWidget(lab)
            bar.addWidget(nxt)
        bar.addWidget(self.status)
        bar.addStretch(1)
        self.buttons: dict[str, QPushButton] = {}
        actions = [("Copy", lambda: QGuiApplication.clipboard().setText(self.message.content))]
        if m.role == "user":
            actions.append(("Edit", self.start_edit))
        else:
            actions.append(("Regenerate", lambda: page.regenerate(m.id)))
        actions.append(("Delete", lambda: page.delete_message(m.id)))
        for name, fn in actions:
            b = QPushButton(name)
            b.setObjectName("Link")
            b.clicked.connect(fn)
            bar.addWidget(b)
            self.buttons[name] = b
        lay.addLayout(bar)
        self.render()

    def render(self, text: str | None = None, streaming: bool = False):
        m = self.message
        t = m.content if text is None else text
        if streaming and not t:
            t = "…"
        self.view.set_markdown(t, is_dark(QApplication.instance()))
        st = m.meta.get("status", "")
        if streaming:
            st = "generating…"
        elif m.state == "interrupted":
            st = "interrupted (the app stopped while this reply was being written)"
        elif m.state == "stopped":
            st = "stopped · " + st if st else "stopped"
        elif m.state == "error":
            st = "error: " + m.meta.get("error", "")
        self.status.setText(st)
        self.status.setObjectName("ErrorText" if m.state == "error" else "MsgStatus")

    def start_edit(self):
        if self.editor is not None:
            return
        self.editor = QPlainTextEdit(self.message.content)
        self.editor.setMinimumHeight(80)
        lay: QVBoxLayout = self.layout()
        lay.insertWidget(2, self.editor)
        self.view.hide()
        row = QHBoxLayout()
        send = QPushButton("Send")
        send.setObjectName("Primary")
        cancel = QPushButton("Cancel")
        row.addStretch(1)
        row.addWidget(cancel)
        row.addWidget(send)
        self._edit_row = QWidget()
        self._edit_row.setLayout(row)
        lay.insertWidget(3, self._edit_row)
        send.clicked.connect(lambda: self.page.edit_and_resend(self.message.id, self.editor.toPlainText()))
        cancel.clicked.connect(self.cancel_edit)
        self.editor.setFocus()

    def cancel_edit(self):
        if self.editor is not None:
            self.editor.deleteLater()
            self._edit_row.deleteLater()
            self.editor = None
            self.view.show()
