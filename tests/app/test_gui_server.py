"""Server switch: on -> a real openai client gets a reply from the app's loaded model; LAN mode needs the
generated key; settings snippets; monitor and settings pages on the same window."""
from __future__ import annotations

import socket

import pytest

pytest.importorskip("PySide6")

from app.store import Store  # noqa: E402


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.fixture
def win(qapp, qtbot, tmp_path, smollm2_path):
    from app.gui.main_window import MainWindow
    store = Store(tmp_path / "s.db")
    w = MainWindow(store, model=str(smollm2_path))
    qtbot.waitUntil(lambda: w.ctl.engine is not None, timeout=60000)
    yield w
    w.close()
    store.close()


def test_server_switch_then_openai_client(win, qtbot):
    openai = pytest.importorskip("openai")
    from app.gui.server_page import server_factory
    assert server_factory() is not None, "app/server create_app is missing"
    port = free_port()
    win.server.port.setValue(port)
    win.server_switch.setChecked(True)                       # the top-bar switch drives the page
    assert win.server.switch.isChecked()
    assert win.server.srv.wait_started(20), win.server.status.text()
    assert win.server.url.text() == f"http://127.0.0.1:{port}/v1"
    assert f"http://127.0.0.1:{port}/v1" in win.server.snippets.toPlainText()
    client = openai.OpenAI(base_url=win.server.url.text(), api_key="not-needed", timeout=60, max_retries=0)
    r = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=6, temperature=0)
    assert r.choices[0].message.content
    win.server_switch.setChecked(False)
    assert not win.server.srv.running and win.server.status.text() == "Off."


def test_lan_needs_key_and_monitor(win, qtbot):
    win.server.lan.setChecked(True)
    key = win.server.key.text()
    assert key.startswith("hj-") and len(key) > 20
    assert win.store.get_setting("server_api_key") == key
    assert "OPENAI_API_KEY=" + key in win.server.snippets.toPlainText()
    win.server.lan.setChecked(False)
    # the monitor shows a running conversation
    chat = win.chat
    chat.new_conversation()
    chat.s_max.setValue(6)
    chat.send("Hello there")
    win.monitor.refresh()
    qtbot.waitUntil(lambda: not chat.generating, timeout=60000)
    win.monitor.refresh()
    assert "running" in win.monitor.engine_label.text()
    assert "CPU mode" in win.monitor.cards["gpu"][0].text()
    assert "CPU path" in win.monitor.cards["pool"][0].text()
    assert "off" in win.monitor.cards["draft"][0].text()


def test_settings_persist_and_remote_endpoint(win, qtbot, tmp_path):
    win.settings.theme.setCurrentIndex(win.settings.theme.findData("dark"))
    assert win.store.get_setting("theme") == "dark"
    from PySide6.QtWidgets import QApplication
    assert QApplication.instance().property("hivejet_dark") is True
    win.settings.theme.setCurrentIndex(win.settings.theme.findData("system"))
    win.settings.threads.setValue(1)
    assert win.store.get_setting("threads") == 1
    # a remote endpoint: the app's own server, spoken to through the OpenAI-compatible client path
    port = free_port()
    win.server.port.setValue(port)
    win.server_switch.setChecked(True)
    assert win.server.srv.wait_started(20), win.server.status.text()
    with qtbot.waitSignal(win.settings.bridge.remoteListed, timeout=20000):
        win.settings.add_remote(f"http://127.0.0.1:{port}/v1", "")
    assert win.settings.r_list.count() >= 1
    win.settings.r_list.setCurrentRow(0)
    from app.gui.controller import RemoteBackend
    url, key, model = win.settings.r_list.item(0).data(0x0100)
    h = RemoteBackend(url, model, key).submit([{"role": "user", "content": "Hi"}],
                                              __import__("engine.sampling", fromlist=["x"]).SamplingParams(max_tokens=4))
    evs = list(h)
    assert evs[-1].reason in ("stop", "length") and any(getattr(e, "text", "") for e in evs[:-1])
    bad = []
    win.settings.bridge.remoteListed.connect(lambda *a: bad.append(a))
    with qtbot.waitSignal(win.settings.bridge.remoteListed, timeout=20000):
        win.settings.add_remote("http://127.0.0.1:9/v1", "")
    assert "cannot connect" in win.settings.r_status.text()
    win.server_switch.setChecked(False)


def test_server_follows_the_loaded_model(win, qtbot, smollm2_path):
    """A running server restarts on the engine of a newly loaded model (it would otherwise keep the shut
    down one), and stops with a message when the model is unloaded."""
    openai = pytest.importorskip("openai")
    port = free_port()
    win.server.port.setValue(port)
    win.server_switch.setChecked(True)
    assert win.server.srv.wait_started(20), win.server.status.text()
    first = win.ctl.engine
    assert win.server.srv.engine is first
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine is not first
    assert win.server.srv.running and win.server.srv.engine is win.ctl.engine, win.server.status.text()
    assert win.server.srv.wait_started(20), win.server.status.text()
    client = openai.OpenAI(base_url=win.server.url.text(), api_key="not-needed", timeout=60, max_retries=0)
    r = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.content
    win.ctl.unload()
    assert not win.server.srv.running and not win.server.switch.isChecked()
    assert "unloaded" in win.server.status.text()


def test_gpu_model_switch_frees_the_old_engine_first(win, qtbot, tmp_path, smollm2_path, monkeypatch):
    """Before a GPU engine is built the loaded GPU engine is shut down (both would not fit a 24 GB card),
    but only once the new file's header reads: a broken file, or a load cancelled meanwhile, leaves the
    loaded model alone. (No GPU here: the loaded engine is marked as a GPU one.)"""
    from engine.gguf.reader import GGUFError
    ctl = win.ctl
    old = ctl.engine
    monkeypatch.setattr(old.config, "device", "cuda")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    token = ctl._load_token = object()
    with pytest.raises(GGUFError):
        ctl._free_device_for(str(bad), token)
    assert ctl.engine is old and ctl.info is not None
    assert not ctl._free_device_for(str(smollm2_path), object())       # superseded or cancelled
    assert ctl.engine is old
    with qtbot.waitSignal(ctl.unloaded, timeout=5000):
        assert ctl._free_device_for(str(smollm2_path), token)
    assert ctl.engine is None and ctl.info is None
    from engine.types import EngineError, Request
    with pytest.raises(EngineError, match="shut down"):
        old.submit(Request(prompt="hi"))


def test_spec_config_choices(tmp_path):
    from app.gui.controller import spec_config
    model = tmp_path / "m" / "model-Q4_K_M.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    assert spec_config("off", str(model)) == ("off", None)
    assert spec_config("ngram", str(model)) == ("ngram", None)
    assert spec_config("bogus", str(model)) == ("off", None)
    assert spec_config("auto", str(model)) == ("mtp+ngram", None)           # no drafter beside it
    drafter = model.parent / "Qwen3-8B-DFlash-b16"                          # z-lab's layout: a directory
    drafter.mkdir()
    assert spec_config("auto", str(model)) == ("mtp+ngram", None)           # (no config.json yet)
    (drafter / "config.json").write_text("{}")
    assert spec_config("auto", str(model)) == ("dflash+ngram", str(drafter))
    assert spec_config("auto", "demo") == ("mtp+ngram", None)               # a catalog name


def test_speculative_decoding_setting_applies_at_load(win, qtbot, smollm2_path):
    """Settings' speculative decoding choice reaches the engine at the next load; "the model's own
    drafter" on a model without an MTP block or a drafter loads with prompt lookup and says why."""
    s = win.settings.spec
    s.setCurrentIndex(s.findData("ngram"))
    assert win.store.get_setting("spec") == "ngram"
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine.config.spec == "ngram" and win.ctl.info.drafts == "ngram"
    assert "drafts: ngram" in win.statusBar().currentMessage()
    s.setCurrentIndex(s.findData("auto"))
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine.config.spec == "ngram" and "MTP" in win.ctl.info.spec_note
    s.setCurrentIndex(s.findData("off"))
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine.config.spec == "off" and win.ctl.info.drafts == ""


def test_long_prompt_pacing_setting_applies_at_load(win, qtbot, smollm2_path):
    """Settings' choice for long prompts beside generating conversations reaches the engine at the next
    load (EngineConfig.prefill_share); a stored value that is not one of the choices loads the default."""
    p = win.settings.pacing
    p.setCurrentIndex(p.findData(1.0))
    assert win.store.get_setting("prefill_share") == 1.0
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine.config.prefill_share == 1.0
    for bad in (7.0, "half"):
        win.store.set_setting("prefill_share", bad)
        with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
            win.load_model(str(smollm2_path))
        assert win.ctl.engine.config.prefill_share == 0.5


def test_parallel_conversations_setting_applies_at_load(win, qtbot, smollm2_path):
    """Settings' parallel conversations reach the engine at the next load (EngineConfig.max_seqs; 16 by
    default, a broken stored value loads the default) and the planner plans for them at once; a load from the
    planner uses the plan's parallel chats and keeps them as the setting."""
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine.config.max_seqs == 16 and win.planner.seqs.value() == 16
    win.settings.parallel.setValue(3)
    assert win.store.get_setting("parallel") == 3 and win.planner.seqs.value() == 3   # the planner follows
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine.config.max_seqs == 3
    win.store.set_setting("parallel", "many")
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win.load_model(str(smollm2_path))
    assert win.ctl.engine.config.max_seqs == 16
    with qtbot.waitSignal(win.ctl.loaded, timeout=60000):
        win._load_from_planner(str(smollm2_path), 512, "f16", 2)
    assert win.ctl.engine.config.max_seqs == 2 and win.ctl.engine.ctx_size == 512
    assert win.store.get_setting("parallel") == 2 and win.settings.parallel.value() == 2


def test_monitor_pool_and_draft_cards():
    """The Monitor's KV and draft cards from engine.stats()'s figures: the GPU path's shared pool, the CPU
    path's kept conversations, speculative decoding off / on without drafts / each drafter's acceptance."""
    from app.gui.monitor_page import draft_text, pool_text
    gpu = dict(kv_pool=dict(capacity_tokens=200_000, used_tokens=50_000, shared=12, parked_blocks=300),
               resident=dict(conversations=3, tokens=40_000))
    assert pool_text(gpu).startswith("50,000 of 200,000 tokens (25.0%)") and "12 blocks shared" in pool_text(gpu)
    assert "not paced" in pool_text(dict(gpu, prefill_pacing=dict(share=1.0, chunks_held=0)))
    assert "1,234 chunks held back" in pool_text(dict(gpu, prefill_pacing=dict(share=0.5, chunks_held=1234)))
    assert "3 conversations kept" in pool_text(dict(kv_pool=None, resident=dict(conversations=3, tokens=9)))
    cpu = dict(kv_pool=dict(path="cpu", capacity_tokens=40_000, used_tokens=10_000, resident_tokens=9000),
               resident=dict(conversations=2, tokens=9000))
    assert pool_text(cpu) == "CPU path · 10,000 of 40,000 tokens (25.0%)<br>2 conversations kept for follow-ups (9,000 tokens)"
    assert "checkpoints" not in pool_text(gpu)
    ck = dict(gpu, kv_pool=dict(gpu["kv_pool"], state_checkpoints=dict(kept=5, max=27, memory="host",
                                                                        bytes=5 * 157 << 20, evicted=0)))
    assert "recurrent-state checkpoints: 5 of 27 in RAM (785.0 MiB)" in pool_text(ck)
    assert draft_text(dict(spec=dict(mode="off"))).startswith("off")
    assert draft_text(dict(spec=dict(mode="ngram", drafters={}))) == "ngram: no drafts yet"
    on = dict(spec=dict(mode="mtp+ngram", drafters=dict(ngram=dict(drafted=200, accepted=50, acceptance=0.25),
                                                          mtp=dict(drafted=1000, accepted=730, acceptance=0.73))))
    assert draft_text(on) == "mtp: 73% of 1,000 drafts accepted<br>ngram: 25% of 200 drafts accepted"


def test_snippets_carry_the_api_model_id_quoted(win, qtbot):
    """The page shows the id clients must send (the one /v1/models lists, not the display name) and the
    Aider line survives being pasted into a shell, even for an id with spaces."""
    import shlex
    import urllib.request
    import json
    from app.gui.server_page import shell_arg
    port = free_port()
    win.server.port.setValue(port)
    win.server_switch.setChecked(True)
    assert win.server.srv.wait_started(20), win.server.status.text()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        served = json.loads(r.read())["data"][0]["id"]
    assert win.server.model_id.text() == served and served != win.ctl.info.name
    aider = next(l for l in win.server.snippets.toPlainText().splitlines() if l.startswith("aider "))
    argv = shlex.split(aider)
    assert argv[argv.index("--model") + 1] == "openai/" + served
    assert f'"openai/{served}"' in aider
    assert f'model: "{served}"' in win.server.snippets.toPlainText()
    assert shlex.split("aider --model " + shell_arg("openai/My Model 7B")) == ["aider", "--model", "openai/My Model 7B"]
    assert shlex.split("x " + shell_arg('a "b" $c')) == ["x", 'a "b" $c']
    win.server_switch.setChecked(False)


def test_request_log(win, qtbot):
    """The server page lists recent requests: time, route, status, tokens generated, duration; a stream's
    tokens and whole duration count too."""
    openai = pytest.importorskip("openai")
    port = free_port()
    win.server.port.setValue(port)
    win.server_switch.setChecked(True)
    assert win.server.srv.wait_started(20), win.server.status.text()
    client = openai.OpenAI(base_url=win.server.url.text(), api_key="not-needed", timeout=60, max_retries=0)
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
                                       temperature=0)
    pieces = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Count"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert pieces
    with pytest.raises(openai.NotFoundError):
        client.get("/nope", cast_to=object)
    import urllib.request
    for path in ("/slots", "/metrics", "/health"):          # monitoring polls stay out of the log
        urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30).read()
    qtbot.waitUntil(lambda: win.server.requests.rowCount() >= 3, timeout=5000)
    rows = [[win.server.requests.item(i, c).text() for c in range(5)] for i in range(win.server.requests.rowCount())]
    assert rows[0][1] == "GET /v1/nope" and rows[0][2] == "404"
    assert rows[1][1] == "POST /v1/chat/completions" and rows[1][2] == "200" and 1 <= int(rows[1][3]) <= 4
    assert rows[2][1] == "POST /v1/chat/completions" and rows[2][3] == str(r.usage.completion_tokens)
    assert rows[2][0].count(":") == 2 and rows[2][4].endswith(("ms", " s"))
    win.server_switch.setChecked(False)
