"""`hivejet top`: the frame from recorded /slots and /metrics (text snapshot), the rows and keys, the agent
workspace and its tools, and `--run 2` against an in-process server on the demo model (mechanics only: a
135M model does not solve the tasks).

Snapshots: tests/app/data/top_slots.json and top_metrics.txt were recorded from the server during a
`--run 2` on the demo model; top_view_extra.json holds the agents' status recorded at the same poll and
one made-up GPU sample (this machine has none). HIVEJET_UPDATE_SNAPSHOTS=1 rewrites the expected frames.
"""
from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path

import pytest

from app.top import add_top_args, run_top
from app.top.agents import Agent, AgentConfig, AgentStatus
from app.top.client import metric, parse_metrics
from app.top.tasks import DEFAULT_TASKS_DIR, ToolError, Workspace, load_tasks
from app.top.view import Snapshot, TopScreen, build_rows, frame_text, sort_rows

DATA = Path(__file__).parent / "data"
UPDATE = os.environ.get("HIVEJET_UPDATE_SNAPSHOTS") == "1"


def recorded_snapshot(agents: bool = True) -> Snapshot:
    slots = json.loads((DATA / "top_slots.json").read_text())
    extra = json.loads((DATA / "top_view_extra.json").read_text())
    return Snapshot(url=extra["url"], t=extra["t"], model=extra["model"], slots=slots["slots"],
                    running=slots["running"], waiting=slots["waiting"],
                    metrics_text=(DATA / "top_metrics.txt").read_text(), gpus=extra["gpus"],
                    gpu_note=extra["gpu_note"], agents=extra["agents"] if agents else [],
                    parked={k: tuple(v) for k, v in extra["parked"].items()})


def check_frame(text: str, name: str) -> None:
    path = DATA / name
    if UPDATE or not path.exists():
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def test_frame_snapshot():
    text = frame_text(recorded_snapshot(), width=120)
    check_frame(text, "top_frame.txt")
    # what the frame must show, whatever the layout
    assert "agent2" in text and "decoding" in text and "549/1024" in text and "2.2" in text
    assert "agent1" in text and "sending" in text and "add 3/3" in text and "1 failed, 0 passed" in text
    assert "running 1  queued 1  2.2 tok/s  KV 549/1024 (54%)" in text
    assert "GPU0 NVIDIA GeForce RTX 4090" in text and "util 87%" in text and "64°C" in text and "312 W/450 W" in text


def test_frame_without_agents_shows_parked_sessions():
    """Plain `hivejet top`: a session that left /slots (its agent is running a tool) shows as parked."""
    snap = recorded_snapshot(agents=False)
    snap.gpus, snap.gpu_note = [], "No NVIDIA GPU: CPU mode (no NVIDIA driver found)"
    text = frame_text(snap, width=100, sort="tok/s", paused=True)
    check_frame(text, "top_frame_plain.txt")
    assert "top-rec-agent1" in text and "parked" in text and "616/1024" in text
    assert "PAUSED" in text and "sort (tok/s)" in text and "CPU mode" in text


def test_rows_states_and_sorting():
    snap = recorded_snapshot()
    snap.agents[0]["state"] = "tool run_tests"
    snap.slots = snap.slots + [dict(snap.slots[0], id=9, session=None, state="prefill 40%", tok_per_s=0.0,
                                    context=900)]
    rows = {r.name: r for r in build_rows(snap)}
    assert rows["agent1"].state == "parked: run_tests" and rows["agent1"].context == 616 and not rows["agent1"].active
    assert rows["agent2"].state == "decoding" and rows["agent2"].task == "add 2/3"
    assert rows["#9"].state == "prefill 40%"
    assert [r.name for r in sort_rows(list(rows.values()), "context")] == ["#9", "agent1", "agent2"]
    assert [r.name for r in sort_rows(list(rows.values()), "state")] == ["agent2", "#9", "agent1"]
    snap.slots[0] = dict(snap.slots[0], draft_proposed=10, draft_accepted=7)
    assert build_rows(snap)[0].state == "drafting 70%"


def test_ctrl_c_in_the_view_is_an_interrupt():
    """Ctrl-C in the live view ends it as an interrupt (run_top then exits 130), not as a quit."""
    from rich.console import Console

    class Poller:
        n = 0

        def poll(self):
            self.n += 1
            if self.n == 3:
                raise KeyboardInterrupt
            return recorded_snapshot()
    screen = TopScreen(Poller(), interval=0.01, console=Console(file=io.StringIO(), width=100))
    screen.run()
    assert screen.quit_requested and isinstance(screen.interrupted, KeyboardInterrupt)
    q = TopScreen(poller=None)
    q.handle_key("q")
    assert q.quit_requested and q.interrupted is None


def test_keys_and_metrics_parsing():
    screen = TopScreen(poller=None)
    for k in "sp":
        screen.handle_key(k)
    assert screen.sort == "tok/s" and screen.paused
    screen.handle_key("q")
    assert screen.quit_requested
    m = parse_metrics((DATA / "top_metrics.txt").read_text())
    assert metric(m, "kv_tokens_used") == 549 and metric(m, "http_requests_total", route="/slots") == 47
    assert metric(m, "requests_finished_total", reason="stop") == 3 and metric(m, "nope", None) is None


def test_shipped_tasks_fail_as_shipped():
    tasks = load_tasks()
    assert 4 <= len(tasks) <= 8 and tasks[0].path.parent == DEFAULT_TASKS_DIR
    for t in tasks:
        assert any(f.name.startswith("test_") for f in t.files()) and t.description
        with Workspace(t, runner="builtin", test_timeout=60) as ws:
            r = ws.run_tests()
            assert not r.passed, (t.name, r.output)


def test_workspace_tools_confined_and_pytest(tmp_path):
    task = load_tasks(DATA / "top_tasks")[0]
    ws = Workspace(task)
    root = ws.root
    try:
        assert "calc.py" in ws.list_files() and "return a - b" in ws.read_file("calc.py")
        for bad in ("/etc/passwd", "../x.py", "a/../../x", "~/x", "", "C:/x"):
            with pytest.raises(ToolError):
                ws.read_file(bad)
        (root / "link").symlink_to(tmp_path)
        with pytest.raises(ToolError):
            ws.write_file("link/evil.py", "x")
        with pytest.raises(ToolError):
            ws.read_file("missing.py")
        r = ws.run_tests()                       # python -m pytest -q
        assert not r.passed and "failed" in r.output
        ws.write_file("calc.py", "def add(a, b):\n    return a + b\n")
        assert ws.run_tests().passed
        agent = Agent(client=None, task=task, status=AgentStatus("a", "s"), config=AgentConfig())
        assert agent.call_tool(ws, "run_tests", "{}").startswith("PASSED") and agent.status.tests_passed
        with pytest.raises(ToolError):
            agent.call_tool(ws, "rm_rf", "{}")
        with pytest.raises(ToolError):
            agent.call_tool(ws, "read_file", "{not json")
    finally:
        ws.close()
    assert not root.exists() and not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def server(smollm2_path):
    from app.server.app import ServerThread, create_app
    from app.server.security import ServerSettings
    from engine.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=1024, max_seqs=4))
    srv = ServerThread(create_app(eng, ServerSettings())).start()
    yield srv
    srv.stop()
    eng.shutdown()


@pytest.mark.slow
def test_run_two_agents_on_demo_model(server, tmp_path):
    """`hivejet top --run 2` on the demo model: every step is a parsed tool call that gets executed, the step
    limit holds, the temporary folders are gone, and the live view and the summary are drawn."""
    import tempfile

    from rich.console import Console
    before = set(Path(tempfile.gettempdir()).glob("hivejet-agent*"))
    p = argparse.ArgumentParser()
    add_top_args(p)
    out = tmp_path / "summary.json"
    args = p.parse_args(["--url", server.url, "--run", "2", "--steps", "3", "--max-tokens", "48",
                         "--tasks", str(DATA / "top_tasks"), "--test-runner", "builtin", "--seed", "1",
                         "--temp", "0.7", "--no-gpu", "--interval", "0.5", "--json", str(out)])
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)  # the live view, drawn into a buffer
    assert run_top(args, console=console) == 0
    s = json.loads(out.read_text())
    assert s["agents"] == 2 and s["tool_calls"] >= 2
    assert s["ttft_median_s"] > 0 and s["completion_tokens"] > 0 and s["tok_per_s"] > 0
    for a in s["per_agent"]:
        assert a["state"] in ("solved", "unsolved") and not a["error"] and a["tool_wait_s"] > 0
        assert a["steps"] == 3 or (a["solved"] and a["steps"] < 3)          # the step limit holds
        assert a["tool_calls"] + a["no_call_steps"] == a["steps"] and a["tool_calls"] >= 1
    assert s["requests"] == sum(a["steps"] for a in s["per_agent"])
    tools = {"list_files", "read_file", "write_file", "run_tests"}
    assert sum(s["tools"].values()) == s["tool_calls"] and set(s["tools"]) <= tools, s["tools"]
    for a in s["per_agent"]:
        assert sum(a["tools"].values()) == a["tool_calls"], a
    assert set(Path(tempfile.gettempdir()).glob("hivejet-agent*")) == before
    text = buf.getvalue()
    assert "HiveJet top" in text and "agent1" in text and "add 3/3" in text   # the view ran
    assert "tasks solved:" in text and "first-token latency: median" in text
    assert "tools called: " + ", ".join(f"{k} {v}" for k, v in s["tools"].items()) in text


@pytest.mark.slow
def test_cancel_breaks_off_streams(server):
    """Quitting the view mid-run: streams in flight are broken off, the server drops the requests, the agents
    stop (no errors) and their folders are removed."""
    import time

    from app.top.agents import AgentRun
    from app.top.client import Client
    client = Client(server.url)
    cfg = AgentConfig(model=client.model_id(), max_steps=3, max_tokens=48, test_runner="builtin")
    run = AgentRun(client, load_tasks(DATA / "top_tasks"), 2, cfg).start()
    t0 = time.monotonic()
    while len(client.get_json("/slots")["slots"]) < 2 and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    run.cancel()
    assert run.wait(10)
    for st in run.statuses:
        assert st.state == "stopped" and not st.error and not Path(st.workspace).exists()
    t0 = time.monotonic()
    while client.get_json("/slots")["slots"] and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert client.get_json("/slots")["slots"] == []


def test_generated_moves_while_requests_stream_and_parked_counts_are_final():
    """`generated` adds the running requests' tokens to the finished ones'; a parked agent's row shows its last
    request's final count (the server's usage), another parked session's last seen value is marked as such."""
    from app.top.view import generated_total
    snap = recorded_snapshot()
    m = snap.metrics
    assert generated_total(snap, m) == metric(m, "generated_tokens_total") + 24
    snap.metrics_text = snap.metrics_text.replace("hivejet_generated_tokens_total 75", "hivejet_generated_tokens_total 0")
    assert generated_total(snap, snap.metrics) == 24 and "generated 24 " in frame_text(snap, width=120)
    snap.agents[0]["last_completion_tokens"] = 600
    last = dict(snap.parked[snap.agents[0]["session"]][0], generated=599)
    snap.parked[snap.agents[0]["session"]] = (last, snap.t)
    rows = {r.name: r for r in build_rows(snap)}
    assert rows["agent1"].generated == 600 and rows["agent1"].gen_final
    snap.agents = []
    rows = {r.name: r for r in build_rows(snap)}
    parked = rows[last["session"]]
    assert parked.generated == 599 and not parked.gen_final
    assert "≥599" in frame_text(snap, width=120)


def test_totals_show_fixed_kv_pool_and_resident_tokens():
    snap = recorded_snapshot()
    snap.metrics_text += ("hivejet_kv_tokens_resident 420\nhivejet_conversations_resident 2\n")
    assert "KV 549/1024 (54%) resident 420 (2 parked)" in frame_text(snap, width=140)


def test_tool_line_and_counts():
    """The latest-output column says what a tool answered, never a line of a file as if the agent wrote it;
    the summary counts the calls per tool."""
    from app.top.agents import format_summary, summarize, tool_line
    assert tool_line("read_file", '{"path": "calc.py"}', "def add(a, b):\n    return a - b\n") == \
        "[tool] read_file(calc.py) -> 2 lines"
    assert tool_line("run_tests", "{}", "FAILED\nF\n1 failed, 0 passed") == "[tool] run_tests() -> FAILED, 1 failed, 0 passed"
    assert tool_line("write_file", '{"path": "a.py", "content": "x"}', "wrote 1 bytes to a.py") == \
        "[tool] write_file(a.py) -> wrote 1 bytes to a.py"
    assert tool_line("list_files", "{}", "calc.py\ntest_calc.py") == "[tool] list_files() -> 2 files"
    assert tool_line("read_file", "{bad", "error: no such file") == "[tool] read_file() -> error: no such file"
    a, b = AgentStatus("agent1", "s1"), AgentStatus("agent2", "s2")
    a.tool_counts, b.tool_counts = {"read_file": 2, "run_tests": 1}, {"read_file": 1, "write_file": 3}
    s = summarize([a, b], 10.0)
    assert s["tools"] == {"read_file": 3, "run_tests": 1, "write_file": 3}
    assert s["per_agent"][1]["tools"] == {"read_file": 1, "write_file": 3}
    assert "tools called: read_file 3, run_tests 1, write_file 3" in format_summary(s)


def test_latest_output_is_shown_as_written():
    """The latest-output column shows a tool line's "[tool]" and a model's brackets as they are (rich
    markup would swallow "[tool]", and a closing tag such as "[/INST]" would stop the view)."""
    snap = recorded_snapshot()
    snap.agents[0]["last_line"] = "[tool] read_file(calc.py) -> 2 lines"
    snap.agents[1]["last_line"] = "[/INST] a[/i] [bold]x"
    snap.agents[1]["task"] = "[/task]"
    text = frame_text(snap, width=160)
    assert "[tool] read_file(calc.py) -> 2 lines" in text and "[/INST] a[/i] [bold]x" in text, text
    assert "[/task]" in text


def test_access_log_leaves_out_polls():
    import logging
    from app.server.access_log import QuietPolls
    f = QuietPolls()

    def rec(method, path, status):
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", method, path, "1.1", status), None)
    assert not f.filter(rec("GET", "/slots", 200)) and not f.filter(rec("GET", "/metrics", 200))
    assert not f.filter(rec("GET", "/health?x=1", 200))
    assert f.filter(rec("GET", "/health", 503)) and f.filter(rec("POST", "/v1/chat/completions", 200))
    assert f.filter(rec("GET", "/v1/models", 200))


@pytest.mark.slow
def test_serve_access_log_leaves_out_answered_polls(smollm2_path):
    """`hivejet serve --log-level info`: the polls of hivejet top, the Monitor and Prometheus (GET /slots,
    /metrics, /health answered) stay out of its access log; other requests, and polls that fail, are in it."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "app.server", "-m", str(smollm2_path), "--port", str(port),
                             "-c", "256", "--log-level", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while "serving" not in proc.stderr.readline():
            assert proc.poll() is None and time.monotonic() - t0 < 120
        for _ in range(3):
            for path in ("/slots", "/metrics", "/health"):
                urllib.request.urlopen(url + path, timeout=30).read()
        urllib.request.urlopen(url + "/v1/models", timeout=30).read()
        req = urllib.request.Request(url + "/slots", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError):              # a refused poll (403) stays in the log
            urllib.request.urlopen(req, timeout=30)
        time.sleep(0.5)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    log = out + err                      # (uvicorn writes its access log to stdout)
    access = [line for line in log.splitlines() if '" 200' in line or '" 403' in line]
    assert any("GET /v1/models" in line for line in access), log[-2000:]
    assert any("GET /slots" in line and '" 403' in line for line in access), log[-2000:]
    assert not [line for line in access if '" 200' in line and any(p in line for p in ("/slots", "/metrics",
                                                                                      "/health"))], access


@pytest.mark.slow
def test_poll_is_two_requests(server):
    """A refresh reads /slots and /metrics; /health only until the server has answered."""
    from app.top.client import Client
    from app.top.view import Poller
    client = Client(server.url)
    calls = []
    get_json, get_text = client.get_json, client.get_text
    client.get_json = lambda path, timeout=None: (calls.append(path), get_json(path, timeout))[1]
    client.get_text = lambda path, timeout=None: (calls.append(path), get_text(path, timeout))[1]
    p = Poller(client, gpu=False)
    snaps = [p.poll() for _ in range(4)]
    assert all(s.status == "ok" and s.metrics_text for s in snaps) and snaps[-1].model
    assert calls == ["/health"] + ["/slots", "/metrics"] * 4


@pytest.mark.slow
def test_quit_mid_step_counts_streamed_tokens(server):
    """Stopping agents mid-stream: the tokens they received count (the stream's usage never came), and so do
    the tool calls made before."""
    import time

    from app.top.agents import AgentRun
    from app.top.client import Client
    client = Client(server.url)
    cfg = AgentConfig(model=client.model_id(), max_steps=3, max_tokens=400, test_runner="builtin", temperature=0.7)
    run = AgentRun(client, load_tasks(DATA / "top_tasks"), 2, cfg).start()
    t0 = time.monotonic()
    # mid-step: a tool call already made, and the next reply streaming
    while not (any(st.tool_calls for st in run.statuses)
               and sum(q.get("generated") or 0 for q in client.get_json("/slots")["slots"]) >= 6):
        assert time.monotonic() - t0 < 120, [vars(st) for st in run.statuses]
        time.sleep(0.05)
    run.cancel()
    assert run.wait(10)
    s = run.summary()
    assert s["completion_tokens"] >= 6 and s["tok_per_s"] > 0
    assert s["tool_calls"] >= 1 and sum(s["tools"].values()) == s["tool_calls"]   # the calls made count too


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="a pseudo-terminal for the keys")
def test_q_mid_step_stops_the_run_with_its_figures(server, tmp_path, monkeypatch):
    """`--run` in the live view, q pressed mid-step (each agent's first tool call made, a next reply
    streaming): the run stops (exit 0), its folders are removed, and the summary counts the tool calls made
    and the tokens of the broken-off streams as well as the finished requests'."""
    import pty
    import sys
    import tempfile
    import threading
    import time

    from rich.console import Console

    from app.top.client import Client
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    master, slave = pty.openpty()
    keyboard = os.fdopen(slave, "r")
    monkeypatch.setattr(sys, "stdin", keyboard)           # KeyReader reads the keys from this terminal
    client = Client(server.url)

    def metrics():
        return parse_metrics(client.get_text("/metrics"))
    t0 = time.monotonic()
    while client.get_json("/slots")["slots"] and time.monotonic() - t0 < 30:   # (an earlier test's, dropping)
        time.sleep(0.05)
    before = metric(metrics(), "generated_tokens_total")
    at_q = {}

    def press_q():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            m = metrics()
            done = metric(m, "requests_finished_total")        # each agent's first reply done: a call made
            streaming = max([q.get("generated") or 0 for q in client.get_json("/slots")["slots"]] or [0])
            if done >= at_q.setdefault("done0", done) + 2 and streaming >= 12:
                at_q["finished"] = metric(m, "generated_tokens_total") - before
                os.write(master, b"q")
                return
            time.sleep(0.05)
    out = tmp_path / "summary.json"
    p = argparse.ArgumentParser()
    add_top_args(p)
    args = p.parse_args(["--url", server.url, "--run", "2", "--steps", "3", "--max-tokens", "400", "--temp", "0.7",
                         "--tasks", str(DATA / "top_tasks"), "--test-runner", "builtin", "--no-gpu",
                         "--interval", "0.2", "--json", str(out)])
    presser = threading.Thread(target=press_q, daemon=True)
    presser.start()
    try:
        code = run_top(args, console=Console(file=io.StringIO(), width=120, force_terminal=True))
    finally:
        keyboard.close()
        os.close(master)
    assert "finished" in at_q, "q was never pressed"
    s = json.loads(out.read_text())
    assert code == 0 and all(a["state"] in ("stopped", "solved") for a in s["per_agent"]), s["per_agent"]
    assert s["tool_calls"] >= 1 and sum(s["tools"].values()) == s["tool_calls"], s
    # the server counts the broken-off requests' tokens too (once they have finished as cancelled); the
    # agents received all but the last few
    t0 = time.monotonic()
    while client.get_json("/slots")["slots"] and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    generated = metric(metrics(), "generated_tokens_total") - before
    assert generated - 8 <= s["completion_tokens"] <= generated and s["completion_tokens"] > at_q["finished"], \
        (s["completion_tokens"], generated, at_q)
    assert not list(tmp_path.glob("hivejet-agent*"))


@pytest.mark.slow
def test_sigterm_and_ctrl_c_stop_cleanly(server, tmp_path, monkeypatch):
    """`--run` stopped by SIGTERM or Ctrl-C: the agents stop, their folders are removed, the summary is
    printed and the exit code says which signal (143, 130), whatever SIGINT's handler was before (here: ignored,
    as an earlier test may leave it), and both handlers are put back."""
    import signal
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))     # this run's folders only (others may run)
    term_handler = signal.getsignal(signal.SIGTERM)
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _stop_runs_by_signal(server, tmp_path, term_handler)
    finally:
        signal.signal(signal.SIGINT, old_int)


def _stop_runs_by_signal(server, tmp_path, term_handler):
    import os
    import signal
    import tempfile
    import threading
    import time

    from rich.console import Console
    p = argparse.ArgumentParser()
    add_top_args(p)
    for signum, view in ((signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True),
                         (signal.SIGINT, True)):
        before = set(Path(tempfile.gettempdir()).glob("hivejet-agent*"))
        args = p.parse_args(["--url", server.url, "--run", "2", "--steps", "3", "--max-tokens", "400",
                             "--tasks", str(DATA / "top_tasks"), "--test-runner", "builtin", "--no-gpu",
                             "--interval", "0.2"] + ([] if view else ["--no-view"]))
        from app.top.client import Client
        client = Client(server.url)
        t0 = time.monotonic()
        while client.get_json("/slots")["slots"] and time.monotonic() - t0 < 30:   # (an earlier run's, dropping)
            time.sleep(0.05)

        def fire():   # once the agents have their folders (they keep them until they stop): mid-run
            t0 = time.monotonic()
            while not list(tmp_path.glob("hivejet-agent*")) and time.monotonic() - t0 < 60:
                time.sleep(0.01)
            os.kill(os.getpid(), signum)
        threading.Thread(target=fire, daemon=True).start()
        buf = io.StringIO()
        code = run_top(args, console=Console(file=buf, width=120, force_terminal=view))   # view: the live screen
        assert code == 128 + signum, (view, buf.getvalue()[-2000:])
        assert "tasks solved:" in buf.getvalue()
        left = [(p, sorted(x.name for x in p.rglob("*"))) for p in tmp_path.glob("hivejet-agent*")]
        assert before == set() and not left, (signum, view, left)
        assert signal.getsignal(signal.SIGTERM) == term_handler          # put back
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
