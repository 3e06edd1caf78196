"""Chat attachments: a file or a pasted image as the attachment dict a message stores (text files up to
2 MB of UTF-8; images as PNG, at most 2048 px a side), their thumbnails, and a message's content as the
model reads it (the text with attached files appended; image parts first when the model sees images)."""
from __future__ import annotations

import base64
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtGui import QImage, QPixmap
from PySide6.QtWidgets import QLabel

from app.gui.icons import pixmap
from app.store import Message

MAX_TEXT_ATTACHMENT = 2 << 20
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp"}


def content_for_model(m: Message) -> str:
    """What the model reads for a message: its text plus the attached text files."""
    parts = [m.content]
    for a in m.attachments:
        if a.get("kind") == "text":
            parts.append(f"\n\n--- attached file: {a['name']} ---\n```\n{a['text']}\n```")
    return "".join(parts)


def message_content(m: Message, images: bool):
    """A message as the model gets it: plain text, or (when the loaded model sees images and the message has
    some) image parts carrying the PNG bytes followed by the text part (engine/vision's message format)."""
    text = content_for_model(m)
    imgs = [a for a in m.attachments if a.get("kind") == "image"] if images else []
    if not imgs:
        return text
    return [{"type": "image", "image": base64.b64decode(a["data"])} for a in imgs] + [{"type": "text", "text": text}]


def load_attachment(path: str | Path) -> dict:
    """A file becomes an attachment dict; raises ValueError with a message for the user."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p.name}: not a file")
    if p.suffix.lower() in IMAGE_SUFFIXES:
        img = QImage(str(p))
        if img.isNull():
            raise ValueError(f"{p.name}: not a readable image")
        return image_attachment(img, p.name)
    if p.stat().st_size > MAX_TEXT_ATTACHMENT:
        raise ValueError(f"{p.name}: {p.stat().st_size // 1024} KB is more than the 2 MB limit for text files")
    raw = p.read_bytes()
    if b"\0" in raw[:8192]:
        raise ValueError(f"{p.name}: not a text file (binary content)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{p.name}: not UTF-8 text") from None
    return {"kind": "text", "name": p.name, "text": text}


def image_attachment(img: QImage, name: str = "pasted image.png") -> dict:
    if img.width() > 2048 or img.height() > 2048:
        img = img.scaled(2048, 2048, Qt.KeepAspectRatio, Qt.SmoothTransformation)
    ba = QByteArray()
    buf = QBuffer(ba)
    buf.open(QIODevice.WriteOnly)
    img.save(buf, "PNG")
    return {"kind": "image", "name": name, "mime": "image/png", "width": img.width(), "height": img.height(),
            "data": base64.b64encode(bytes(ba)).decode()}


def file_icon_label() -> QLabel:
    lab = QLabel()
    lab.setPixmap(pixmap("file", 16))
    return lab


def attachment_pixmap(a: dict, size: int = 96) -> QPixmap:
    img = QImage.fromData(base64.b64decode(a["data"]))
    return QPixmap.fromImage(img).scaled(size, size, Qt.KeepAspectRatio, Qt.SmoothTransformation)
