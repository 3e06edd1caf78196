"""app/store.py: conversations, branched messages, settings; WAL; a crash mid-reply keeps the text."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from app.store import Store


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "t.db")
    yield s
    s.close()


def test_wal_and_roundtrip(store, tmp_path):
    assert store.journal_mode == "wal"
    c = store.create_conversation("hello", system_prompt="be brief", sampling={"temperature": 0.2})
    u = store.add_message(c.id, "user", "hi", attachments=[{"kind": "text", "name": "a.txt", "text": "x"}])
    a = store.add_message(c.id, "assistant", "hello!", u.id)
    store.close()
    s2 = Store(tmp_path / "t.db")
    c2 = s2.get_conversation(c.id)
    assert c2.system_prompt == "be brief" and c2.sampling == {"temperature": 0.2}
    th = s2.thread(c.id)
    assert [m.content for m in th] == ["hi", "hello!"]
    assert th[0].attachments[0]["name"] == "a.txt"
    assert c2.current_leaf == a.id
    s2.close()


def test_branches_regenerate_and_edit(store):
    c = store.create_conversation()
    u1 = store.add_message(c.id, "user", "q1")
    a1 = store.add_message(c.id, "assistant", "r1", u1.id)
    a1b = store.add_message(c.id, "assistant", "r1-regenerated", u1.id)   # regenerate: sibling
    assert [m.id for m in store.siblings(a1.id)] == [a1.id, a1b.id]
    assert [m.content for m in store.thread(c.id)] == ["q1", "r1-regenerated"]
    u1b = store.add_message(c.id, "user", "q1 edited")                      # edit-and-resend: root sibling
    a2 = store.add_message(c.id, "assistant", "r2", u1b.id)
    assert [m.content for m in store.thread(c.id)] == ["q1 edited", "r2"]
    store.switch_branch(u1.id)                                             # back to the first branch
    assert [m.content for m in store.thread(c.id)] == ["q1", "r1-regenerated"]
    store.switch_branch(a1.id)
    assert [m.content for m in store.thread(c.id)] == ["q1", "r1"]
    store.delete_message(u1.id)                                            # deletes its subtree
    assert store.get_message(a1.id) is None and store.get_message(a1b.id) is None
    assert [m.content for m in store.thread(c.id)] == ["q1 edited", "r2"]
    assert a2.id == store.get_conversation(c.id).current_leaf


def test_delete_conversation_and_order(store):
    c1 = store.create_conversation("one")
    store.create_conversation("two")
    store.add_message(c1.id, "user", "newer")
    assert [c.title for c in store.list_conversations()] == ["one", "two"]
    store.delete_conversation(c1.id)
    assert [c.title for c in store.list_conversations()] == ["two"]
    assert store.messages(c1.id) == []


def test_settings(store, tmp_path):
    store.set_setting("theme", "dark")
    store.set_setting("threads", 3)
    store.set_setting("theme", "system")
    assert store.get_setting("theme") == "system" and store.get_setting("threads") == 3
    assert store.get_setting("missing", 7) == 7


def test_crash_mid_reply_keeps_text(tmp_path):
    db = tmp_path / "crash.db"
    code = textwrap.dedent(f"""
        import os
        from app.store import Store
        s = Store({str(db)!r})
        c = s.create_conversation("c")
        u = s.add_message(c.id, "user", "tell me")
        a = s.add_message(c.id, "assistant", "", u.id, state="streaming")
        s.update_message(a.id, content="partial ans")
        os._exit(9)   # no close, no commit hooks: a crash
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    s = Store(db)
    c = s.list_conversations()[0]
    th = s.thread(c.id)
    assert th[-1].content == "partial ans" and th[-1].state == "interrupted"
    s.close()
