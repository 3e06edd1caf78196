"""Tool-using coding agents over the OpenAI API: each gets a task, works in its own temporary folder through
tool calls (read_file, write_file, list_files, run_tests) and stops when the tests pass or after a step
limit. `run_agents` runs N of them in threads; `summarize` / `format_summary` give the numbers the
multi-agent benchmark reports."""
from __future__ import annotations

import json
import re
import secrets
import statistics
import threading
import time
from dataclasses import dataclass, field

from app.top.client import Client, ServerError, abort
from app.top.tasks import Task, ToolError, Workspace, clip

_MARKUP = re.compile(r"^</?[\w|\[\]]*>?$")   # a line that is only a tag (or the start of one)
_PATH = {"type": "string", "maxLength": 120}
TOOLS = [
    {"type": "function", "function": {
        "name": "list_files", "description": "List the files.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": _PATH}, "required": ["path"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a whole file.",
        "parameters": {"type": "object", "properties": {"path": _PATH, "content": {"type": "string"}},
                       "required": ["path", "content"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the tests (pytest).",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]

SYSTEM = ("You fix small Python exercises. Paths are relative to the task folder. Call one tool per turn; "
          "you are done when run_tests passes.")


def tool_line(name: str, arguments: str, answer: str) -> str:
    """The view's latest-output line for a tool call: the call (name and path) and what came back, said as
    the tool's answer (a file's last line is not shown as if the agent had written it)."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        args = {}
    path = args.get("path") if isinstance(args, dict) and isinstance(args.get("path"), str) else None
    call = f"{name}({path})" if path else f"{name}()"
    lines = [ln.strip() for ln in answer.splitlines() if ln.strip()]
    if answer.startswith("error:"):
        said = lines[0]
    elif name == "read_file":
        said = f"{len(answer.splitlines())} lines"
    elif name == "list_files":
        said = f"{len(lines)} files" if lines and lines[0] != "(no files)" else "no files"
    elif name == "run_tests" and lines:
        said = lines[0] + (f", {lines[-1]}" if len(lines) > 1 else "")
    else:
        said = lines[0] if lines else "(no output)"
    return f"[tool] {call} -> {said}"[:200]


@dataclass
class AgentStatus:
    """What an agent is doing, for the view and the summary (written by the agent's thread)."""
    name: str
    session: str
    task: str = ""
    state: str = "starting"        # starting | generating | tool <name> | solved | unsolved | error | stopped
    step: int = 0
    max_steps: int = 0
    last_line: str = ""            # latest line of output (generated text or a tool's result)
    requests: int = 0
    tool_calls: int = 0            # tool calls parsed and executed
    tool_counts: dict = field(default_factory=dict)    # tool name -> calls executed
    last_completion_tokens: int | None = None          # the last finished request's tokens (server's usage)
    tool_errors: int = 0           # of which the tool refused or failed
    no_call_steps: int = 0         # steps whose answer had no tool call
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gen_seconds: float = 0.0       # time in chat requests
    tool_seconds: float = 0.0      # time waiting on tools
    ttfts: list = field(default_factory=list)
    tests_passed: bool = False
    solved: bool = False
    error: str = ""
    started: float = 0.0
    finished: float = 0.0
    workspace: str = ""            # its temporary folder (removed at the end)
    done: bool = False

    def note(self, text: str) -> None:
        """Remember the last meaningful line of `text` (markup-only lines such as </tool_call> are skipped)."""
        lines = [ln.strip() for ln in text.replace("\\n", "\n").splitlines() if ln.strip()]
        useful = [ln for ln in lines if not _MARKUP.match(ln)]
        if useful or lines:
            self.last_line = (useful or lines)[-1][:200]

    @property
    def tok_per_s(self) -> float:
        return self.completion_tokens / self.gen_seconds if self.gen_seconds > 0 else 0.0


@dataclass
class AgentConfig:
    model: str = "hivejet"
    max_steps: int = 12
    max_tokens: int = 1024
    temperature: float = 0.2
    seed: int | None = None
    tool_choice: str = "required"
    test_timeout: float = 60.0
    test_runner: str = "pytest"    # pytest | builtin
    request_timeout: float = 900.0


class Agent:
    def __init__(self, client: Client, task: Task, status: AgentStatus, config: AgentConfig,
                 stop: threading.Event | None = None, index: int = 0):
        self.client, self.task, self.status, self.config = client, task, status, config
        self.index = index
        self.conn = None               # the open chat stream (AgentRun.cancel breaks it off)
        self.stop = stop or threading.Event()

    # ----- tools
    def call_tool(self, ws: Workspace, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise ToolError(f"arguments are not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ToolError("arguments must be a JSON object")
        if name == "list_files":
            return ws.list_files()
        if name == "read_file":
            return ws.read_file(args.get("path"))
        if name == "write_file":
            return ws.write_file(args.get("path"), args.get("content"))
        if name == "run_tests":
            r = ws.run_tests()
            self.status.tests_passed = r.passed
            return ("PASSED\n" if r.passed else "FAILED\n") + r.output.strip()
        raise ToolError(f"unknown tool {name!r}; the tools are list_files, read_file, write_file, run_tests")

    def _chat(self, body: dict, on_text):
        """One streamed request; a full queue (429) is retried after a pause."""
        for attempt in range(60):
            try:
                return self.client.chat_stream(body, on_text=on_text, cancel=self.stop,
                                               timeout=self.config.request_timeout, session=self.status.session,
                                               on_connect=self._connected)
            except ServerError as e:
                if e.status != 429 or self.stop.is_set() or attempt == 59:
                    raise
                self.status.state = "retrying (queue full)"
                self.stop.wait(2.0)
            finally:
                self.conn = None

    def _connected(self, conn) -> None:
        self.conn = conn
        if self.stop.is_set():
            abort(conn)

    def abort(self) -> None:
        conn = self.conn
        if conn is not None:
            abort(conn)

    def first_message(self, ws: Workspace) -> str:
        return f"{self.task.description}\n\nFiles:\n{ws.list_files()}"

    # ----- the loop
    def run(self) -> AgentStatus:
        st, cfg = self.status, self.config
        st.task, st.max_steps, st.started = self.task.name, cfg.max_steps, time.monotonic()
        ws = Workspace(self.task, prefix=f"hivejet-{st.name}-", test_timeout=cfg.test_timeout,
                       runner=cfg.test_runner)
        st.workspace = str(ws.root)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.first_message(ws)}]
        try:
            while st.step < cfg.max_steps and not self.stop.is_set():
                if not self._turn(ws, messages):
                    break
            # the verdict: the tests as the agent left the folder (its own run counts when it was the last step)
            if not st.tests_passed and not self.stop.is_set():
                st.state = "checking"
                t0 = time.monotonic()
                st.tests_passed = ws.run_tests().passed
                st.tool_seconds += time.monotonic() - t0
            st.solved = st.tests_passed
            st.state = "stopped" if self.stop.is_set() and not st.solved else ("solved" if st.solved else "unsolved")
        except ServerError as e:
            if self.stop.is_set():
                st.state = "stopped"
            else:
                st.error, st.state = str(e), "error"
                st.note(f"error: {e}")
        except Exception as e:
            st.error, st.state = f"{type(e).__name__}: {e}", "error"
            st.note(f"error: {st.error}")
        finally:
            ws.close()
            st.finished = time.monotonic()
            st.done = True
        return st

    def _turn(self, ws: Workspace, messages: list[dict]) -> bool:
        """One step: a reply, and the tool call it makes; False when the agent is done (context full,
        cancelled, or its own test run passed)."""
        st = self.status
        st.step += 1
        st.state = "generating"
        res = self._reply(messages)
        if res is None or res.finish_reason == "cancelled":
            return False
        calls = res.tool_calls[:1]  # one call per turn, as the system prompt asks
        if not calls:
            st.no_call_steps += 1
            messages.append({"role": "assistant", "content": res.content or ""})
            messages.append({"role": "user", "content": "Call one of the tools (list_files, read_file, "
                                                        "write_file, run_tests)."})
            return True
        call = calls[0]
        call_id = call["id"] or f"call_{st.step}"
        messages.append({"role": "assistant", "content": res.content or None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"] or "{}"}}]})
        answer = self._use_tool(ws, call)
        messages.append({"role": "tool", "tool_call_id": call_id, "name": call["name"], "content": clip(answer)})
        return not (call["name"] == "run_tests" and st.tests_passed)

    def _reply(self, messages: list[dict]):
        """The model's reply to the conversation so far (its figures added to the status); None when the
        conversation has filled its context."""
        st, cfg = self.status, self.config
        body = {"model": cfg.model, "messages": messages, "tools": TOOLS, "tool_choice": cfg.tool_choice,
                "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "user": st.session,
                "logprobs": True, "parallel_tool_calls": False}
        if cfg.seed is not None:
            body["seed"] = cfg.seed + 1000 * self.index + st.step
        buf = []

        def on_text(piece):
            buf.append(piece)
            st.note("".join(buf)[-400:])
        try:
            res = self._chat(body, on_text)
        except ServerError as e:
            if e.code == "context_length_exceeded":   # the conversation filled its context: give up
                st.note(f"context full: {e}")
                return None
            raise
        st.requests += 1
        st.gen_seconds += res.seconds
        st.prompt_tokens += res.prompt_tokens
        st.completion_tokens += res.completion_tokens
        st.last_completion_tokens = res.completion_tokens
        if res.ttft is not None:
            st.ttfts.append(res.ttft)
        return res

    def _use_tool(self, ws: Workspace, call: dict) -> str:
        """Run a tool call; its answer (a failing tool answers with the error, it does not end the agent)."""
        st = self.status
        st.state = f"tool {call['name']}"
        t0 = time.monotonic()
        try:
            answer = self.call_tool(ws, call["name"], call["arguments"])
        except ToolError as e:
            st.tool_errors += 1
            answer = f"error: {e}"
        except Exception as e:  # a tool must not end the agent
            st.tool_errors += 1
            answer = f"error: {type(e).__name__}: {e}"
        st.tool_seconds += time.monotonic() - t0
        st.tool_calls += 1
        st.tool_counts[call["name"]] = st.tool_counts.get(call["name"], 0) + 1
        st.last_line = tool_line(call["name"], call["arguments"], answer)
        return answer


def make_statuses(n: int, tasks: list[Task], run_id: str | None = None) -> list[tuple[AgentStatus, Task]]:
    run_id = run_id or secrets.token_hex(3)
    return [(AgentStatus(name=f"agent{i + 1}", session=f"top-{run_id}-agent{i + 1}"), tasks[i % len(tasks)])
            for i in range(n)]


class AgentRun:
    """N agents in threads against one server."""

    def __init__(self, client: Client, tasks: list[Task], n: int, config: AgentConfig, run_id: str | None = None):
        self.client, self.config = client, config
        self.stop = threading.Event()
        self.agents = [Agent(client, task, st, config, self.stop, i)
                       for i, (st, task) in enumerate(make_statuses(n, tasks, run_id))]
        self.threads: list[threading.Thread] = []
        # one per agent, set when its run() has returned (its folder removed): done() reads these, not
        # Thread.is_alive(), which a join interrupted by Ctrl-C can leave False while the thread still runs
        self.finished: list[threading.Event] = []
        self.t0 = self.t1 = 0.0

    @property
    def statuses(self) -> list[AgentStatus]:
        return [a.status for a in self.agents]

    def start(self) -> "AgentRun":
        self.t0 = time.monotonic()
        for a in self.agents:
            ev = threading.Event()
            t = threading.Thread(target=self._run_one, args=(a, ev), name=f"hivejet-{a.status.name}", daemon=True)
            self.threads.append(t)
            self.finished.append(ev)
            t.start()
        return self

    @staticmethod
    def _run_one(agent: Agent, finished: threading.Event) -> None:
        try:
            agent.run()
        finally:
            finished.set()

    def done(self) -> bool:
        return len(self.finished) == len(self.agents) and all(ev.is_set() for ev in self.finished)

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        for ev in self.finished:
            ev.wait(None if end is None else max(0.0, end - time.monotonic()))
        if self.done() and not self.t1:
            self.t1 = time.monotonic()
        return self.done()

    def cancel(self) -> None:
        """Stop every agent: streams in flight are broken off (the server cancels them), tools finish."""
        self.stop.set()
        for a in self.agents:
            a.abort()

    def summary(self) -> dict:
        return summarize(self.statuses, (self.t1 or time.monotonic()) - self.t0)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(round(q * (len(v) - 1)))))
    return v[k]


def tool_totals(statuses: list[AgentStatus]) -> dict[str, int]:
    """Calls executed per tool, over all agents (by name)."""
    out: dict[str, int] = {}
    for s in statuses:
        for name, n in s.tool_counts.items():
            out[name] = out.get(name, 0) + n
    return dict(sorted(out.items()))


def summarize(statuses: list[AgentStatus], wall_s: float) -> dict:
    ttfts = [t for s in statuses for t in s.ttfts]
    gen = sum(s.completion_tokens for s in statuses)
    return {
        "agents": len(statuses),
        "solved": sum(s.solved for s in statuses),
        "wall_s": wall_s,
        "completion_tokens": gen,
        "prompt_tokens": sum(s.prompt_tokens for s in statuses),
        "tok_per_s": gen / wall_s if wall_s > 0 else 0.0,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": _pct(ttfts, 0.95),
        "tool_wait_s": sum(s.tool_seconds for s in statuses),
        "requests": sum(s.requests for s in statuses),
        "tool_calls": sum(s.tool_calls for s in statuses),
        "tools": tool_totals(statuses),
        "per_agent": [{"name": s.name, "session": s.session, "task": s.task, "state": s.state, "steps": s.step,
                       "solved": s.solved, "tool_calls": s.tool_calls, "tools": dict(sorted(s.tool_counts.items())),
                       "tool_errors": s.tool_errors,
                       "no_call_steps": s.no_call_steps, "completion_tokens": s.completion_tokens,
                       "tok_per_s": s.tok_per_s, "ttft_median_s": statistics.median(s.ttfts) if s.ttfts else None,
                       "tool_wait_s": s.tool_seconds, "error": s.error} for s in statuses],
    }


def _s(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f} {unit}"


def format_summary(summary: dict) -> str:
    s = summary
    lines = [f"tasks solved: {s['solved']}/{s['agents']}   wall {s['wall_s']:.1f} s   "
             f"{s['requests']} requests, {s['tool_calls']} tool calls",
             f"total: {s['completion_tokens']} tokens generated, {s['tok_per_s']:.2f} tok/s   "
             f"({s['prompt_tokens']} prompt tokens)",
             f"first-token latency: median {_s(s['ttft_median_s'])}, p95 {_s(s['ttft_p95_s'])}",
             f"waiting on tools: {s['tool_wait_s']:.2f} s",
             "tools called: " + (", ".join(f"{k} {v}" for k, v in s.get("tools", {}).items()) or "none"),
             "",
             f"{'agent':<10} {'task':<16} {'result':<9} {'steps':>5} {'calls':>5} {'tok/s':>7} "
             f"{'ttft med':>9} {'tools':>8}"]
    for a in s["per_agent"]:
        lines.append(f"{a['name']:<10} {a['task'][:16]:<16} {a['state'][:9]:<9} {a['steps']:>5} {a['tool_calls']:>5} "
                     f"{a['tok_per_s']:>7.2f} {_s(a['ttft_median_s']):>9} {a['tool_wait_s']:>6.2f} s"
                     + (f"   {a['error']}" if a["error"] else ""))
    return "\n".join(lines)
