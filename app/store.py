"""Conversations and settings, stored in one SQLite database (WAL journal) in the user's data folder.

Messages form a tree: every message has a parent (None for the first one of a conversation). Editing a
user message and sending it again, or regenerating a reply, adds a *sibling* instead of overwriting, so
every earlier version stays reachable (branches). A conversation remembers the leaf of the branch shown
(`current_leaf`); the visible thread is the path from the root to that leaf.

A reply is written while it streams (`state='streaming'`, content flushed every few hundred ms by the
caller). Opening the store marks replies still 'streaming' as 'interrupted', so a crash mid-reply keeps
the text produced so far and says what happened.

The database lives in platformdirs' user data folder (`~/.local/share/hivejet/hivejet.db` on Linux);
HIVEJET_HOME overrides the folder (tests use it).
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL DEFAULT 'New chat',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',
    model TEXT NOT NULL DEFAULT '',
    current_leaf TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    id TEXT PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id TEXT REFERENCES messages(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    attachments TEXT NOT NULL DEFAULT '[]',
    state TEXT NOT NULL DEFAULT 'complete',
    meta TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_conv ON messages(conversation_id);
CREATE INDEX IF NOT EXISTS messages_parent ON messages(parent_id);
CREATE TABLE IF NOT EXISTS settings (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

MESSAGE_STATES = ("complete", "streaming", "interrupted", "stopped", "error")


def data_dir() -> Path:
    env = os.environ.get("HIVEJET_HOME")
    d = Path(env) if env else Path(platformdirs.user_data_dir("hivejet"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def default_db_path() -> Path:
    return data_dir() / "hivejet.db"


@dataclass
class Message:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    attachments: list[dict] = field(default_factory=list)
    state: str = "complete"
    meta: dict = field(default_factory=dict)
    created: float = 0.0
    seq: int = 0


@dataclass
class Conversation:
    id: str
    title: str
    created: float
    updated: float
    system_prompt: str = ""
    sampling: dict = field(default_factory=dict)
    model: str = ""
    current_leaf: str | None = None


def _new_id() -> str:
    return uuid.uuid4().hex


class Store:
    """Thread-safe (one connection guarded by a lock); every write is its own transaction."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=10)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            # replies that were streaming when the app last stopped: keep the text, say so
            self._db.execute("UPDATE messages SET state='interrupted' WHERE state='streaming'")
        self._seq = self._max_seq()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def journal_mode(self) -> str:
        with self._lock:
            return self._db.execute("PRAGMA journal_mode").fetchone()[0]

    def _max_seq(self) -> int:
        with self._lock:
            r = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM messages").fetchone()
        return int(r[0])

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ----- conversations -----
    def create_conversation(self, title: str = "New chat", system_prompt: str = "", sampling: dict | None = None,
                            model: str = "") -> Conversation:
        now = time.time()
        c = Conversation(_new_id(), title, now, now, system_prompt, dict(sampling or {}), model, None)
        with self._lock:
            self._db.execute(
                "INSERT INTO conversations(id,title,created,updated,system_prompt,sampling,model,current_leaf)"
                " VALUES(?,?,?,?,?,?,?,?)",
                (c.id, c.title, c.created, c.updated, c.system_prompt, json.dumps(c.sampling), c.model, None))
        return c

    @staticmethod
    def _conv(row) -> Conversation:
        return Conversation(row["id"], row["title"], row["created"], row["updated"], row["system_prompt"],
                            json.loads(row["sampling"] or "{}"), row["model"], row["current_leaf"])

    def get_conversation(self, cid: str) -> Conversation | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM conversations WHERE id=?", (cid,)).fetchone()
        return self._conv(row) if row else None

    def list_conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM conversations ORDER BY updated DESC").fetchall()
        return [self._conv(r) for r in rows]

    def update_conversation(self, cid: str, **fields: Any) -> None:
        allowed = {"title", "system_prompt", "sampling", "model", "current_leaf"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"unknown conversation fields: {sorted(bad)}")
        if "sampling" in fields:
            fields["sampling"] = json.dumps(fields["sampling"])
        fields["updated"] = time.time()
        cols = ",".join(f"{k}=?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE conversations SET {cols} WHERE id=?", (*fields.values(), cid))

    def delete_conversation(self, cid: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM messages WHERE conversation_id=?", (cid,))
            self._db.execute("DELETE FROM conversations WHERE id=?", (cid,))

    # ----- messages -----
    @staticmethod
    def _msg(row) -> Message:
        return Message(row["id"], row["conversation_id"], row["parent_id"], row["role"], row["content"],
                       json.loads(row["attachments"] or "[]"), row["state"], json.loads(row["meta"] or "{}"),
                       row["created"], row["seq"])

    def add_message(self, cid: str, role: str, content: str, parent_id: str | None = None, *,
                    attachments: list[dict] | None = None, state: str = "complete", meta: dict | None = None,
                    make_current: bool = True) -> Message:
        if role not in ("user", "assistant", "system", "tool"):
            raise ValueError(f"bad role {role!r}")
        if state not in MESSAGE_STATES:
            raise ValueError(f"bad state {state!r}")
        with self._lock:
            m = Message(_new_id(), cid, parent_id, role, content, list(attachments or []), state, dict(meta or {}),
                        time.time(), self._next_seq())
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT INTO messages(id,conversation_id,parent_id,role,content,attachments,state,meta,created,seq)"
                    " VALUES(?,?,?,?,?,?,?,?,?,?)",
                    (m.id, cid, parent_id, role, content, json.dumps(m.attachments), state, json.dumps(m.meta),
                     m.created, m.seq))
                if make_current:
                    self._db.execute("UPDATE conversations SET current_leaf=?, updated=? WHERE id=?",
                                     (m.id, m.created, cid))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return m

    def get_message(self, mid: str) -> Message | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM messages WHERE id=?", (mid,)).fetchone()
        return self._msg(row) if row else None

    def update_message(self, mid: str, *, content: str | None = None, state: str | None = None,
                       meta: dict | None = None) -> None:
        sets, vals = [], []
        if content is not None:
            sets.append("content=?"); vals.append(content)
        if state is not None:
            if state not in MESSAGE_STATES:
                raise ValueError(f"bad state {state!r}")
            sets.append("state=?"); vals.append(state)
        if meta is not None:
            sets.append("meta=?"); vals.append(json.dumps(meta))
        if not sets:
            return
        with self._lock:
            self._db.execute(f"UPDATE messages SET {','.join(sets)} WHERE id=?", (*vals, mid))

    def messages(self, cid: str) -> list[Message]:
        """Every message of a conversation, all branches, in creation order."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM messages WHERE conversation_id=? ORDER BY seq", (cid,)).fetchall()
        return [self._msg(r) for r in rows]

    def children(self, cid: str, parent_id: str | None) -> list[Message]:
        with self._lock:
            if parent_id is None:
                rows = self._db.execute("SELECT * FROM messages WHERE conversation_id=? AND parent_id IS NULL "
                                        "ORDER BY seq", (cid,)).fetchall()
            else:
                rows = self._db.execute("SELECT * FROM messages WHERE parent_id=? ORDER BY seq", (parent_id,)).fetchall()
        return [self._msg(r) for r in rows]

    def siblings(self, mid: str) -> list[Message]:
        """The message and its alternatives (same parent), oldest first."""
        m = self.get_message(mid)
        if m is None:
            return []
        return self.children(m.conversation_id, m.parent_id)

    def thread(self, cid: str, leaf_id: str | None = None) -> list[Message]:
        """The visible branch: root -> leaf (the conversation's current leaf by default)."""
        if leaf_id is None:
            c = self.get_conversation(cid)
            leaf_id = c.current_leaf if c else None
        if leaf_id is None:
            return []
        by_id = {m.id: m for m in self.messages(cid)}
        out = []
        cur = by_id.get(leaf_id)
        while cur is not None:
            out.append(cur)
            cur = by_id.get(cur.parent_id) if cur.parent_id else None
        return out[::-1]

    def latest_leaf(self, mid: str) -> str:
        """The newest descendant reached by always following the newest child (to show a branch)."""
        m = self.get_message(mid)
        cur = m
        while cur is not None:
            kids = self.children(cur.conversation_id, cur.id)
            if not kids:
                return cur.id
            cur = kids[-1]
        return mid

    def switch_branch(self, mid: str) -> None:
        """Show the branch through message `mid` (its newest continuation)."""
        m = self.get_message(mid)
        if m is None:
            raise KeyError(mid)
        self.update_conversation(m.conversation_id, current_leaf=self.latest_leaf(mid))

    def delete_message(self, mid: str) -> None:
        """Delete a message and everything after it on its branch(es). The conversation then shows
        the parent's branch (or a sibling's, if there is one)."""
        m = self.get_message(mid)
        if m is None:
            return
        doomed, stack = [], [mid]
        while stack:
            x = stack.pop()
            doomed.append(x)
            with self._lock:
                stack.extend(r[0] for r in self._db.execute("SELECT id FROM messages WHERE parent_id=?", (x,)))
        c = self.get_conversation(m.conversation_id)
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for x in reversed(doomed):
                    self._db.execute("DELETE FROM messages WHERE id=?", (x,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        if c and (c.current_leaf in doomed or c.current_leaf is None):
            sibs = self.children(m.conversation_id, m.parent_id)
            if sibs:
                leaf = self.latest_leaf(sibs[-1].id)
            else:
                leaf = m.parent_id
            self.update_conversation(m.conversation_id, current_leaf=leaf)

    # ----- settings -----
    def get_setting(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_setting(self, key: str, value: Any) -> None:
        with self._lock:
            self._db.execute("INSERT INTO settings(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                             (key, json.dumps(value)))

    def all_settings(self) -> dict[str, Any]:
        with self._lock:
            return {r[0]: json.loads(r[1]) for r in self._db.execute("SELECT key,value FROM settings")}
