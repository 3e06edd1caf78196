"""The `hivejet top` screen: one row per conversation (agent), totals, GPU numbers, from the server's /slots
and /metrics (plus the local agents' own status when `--run` drives them).

`Poller.poll()` takes a `Snapshot`; `render(snapshot, sort, paused)` turns it into a rich renderable (pure:
the same snapshot gives the same frame, which the snapshot test relies on); `TopScreen` refreshes it in a
rich Live several times a second and reads keys (q quit, s sort, p pause).
"""
from __future__ import annotations

import os
import select
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from app.top.client import Client, ServerError, metric, parse_metrics

SORTS = ("agent", "tok/s", "context", "state")
PARKED_KEEP_S = 600.0              # a conversation not in /slots any more is shown "parked" this long


@dataclass
class Row:
    name: str
    session: str | None
    state: str
    tok_per_s: float
    context: int
    ctx_limit: int
    generated: int
    task: str = ""
    last_line: str = ""
    active: bool = True            # in /slots now
    gen_final: bool = True         # False: the last value seen in /slots, the request went on after it


@dataclass
class Snapshot:
    url: str
    t: float = 0.0                          # time.time() of the poll
    model: str = ""
    status: str = "ok"                      # ok | loading | down
    error: str = ""
    slots: list = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    metrics_text: str = ""
    gpus: list = field(default_factory=list)            # dicts of app.gpu.GpuSample (+ name)
    gpu_note: str = ""                                  # why there are no GPU numbers
    agents: list = field(default_factory=list)          # dicts of app.top.agents.AgentStatus
    parked: dict = field(default_factory=dict)          # session -> (last slot dict, last seen t)

    @property
    def metrics(self) -> dict:
        return parse_metrics(self.metrics_text)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Snapshot":
        return cls(**d)


# ----------------------------------------------------------------------------------------------- rows
def _slot_state(q: dict) -> str:
    st = q.get("state") or "?"
    if st == "queued" and q.get("queue_position"):
        return f"queued #{q['queue_position']}"
    prop, acc = q.get("draft_proposed"), q.get("draft_accepted")
    if st == "decoding" and prop:
        return f"drafting {100 * (acc or 0) / prop:.0f}%"
    return st


def build_rows(snap: Snapshot) -> list[Row]:
    """One row per conversation: the sequences in /slots, the local agents (parked while they wait on a
    tool or are done) and sessions seen earlier that are not running now (parked)."""
    agents = {a["session"]: a for a in snap.agents}
    rows: list[Row] = []
    seen = set()
    for q in snap.slots:
        sess = q.get("session")
        a = agents.get(sess) if sess else None
        name = a["name"] if a else (sess or f"#{q.get('id')}")
        task = _task_of(a)
        rows.append(Row(name, sess, _slot_state(q), float(q.get("tok_per_s") or 0.0), int(q.get("context") or 0),
                        int(q.get("ctx_limit") or 0), int(q.get("generated") or 0), task,
                        a["last_line"] if a else "", True))
        if sess:
            seen.add(sess)
    for a in snap.agents:
        if a["session"] in seen:
            continue
        last = (snap.parked.get(a["session"]) or [{}])[0]
        if a["done"]:
            state = a["state"]
        elif a["state"] == "starting":
            state = "starting"
        elif a["state"].startswith("tool") or a["state"] == "checking":
            state = f"parked: {a['state'].replace('tool ', '')}"   # its KV waits while a tool runs
        else:
            state = "sending"       # a request on its way (not admitted by the engine yet)
        # the agent knows its last request's final count (the server's usage); /slots' last value may be short
        gen = a.get("last_completion_tokens")
        rows.append(Row(a["name"], a["session"], state, 0.0, int(last.get("context") or 0),
                        int(last.get("ctx_limit") or 0), int(gen if gen is not None else last.get("generated") or 0),
                        _task_of(a), a["last_line"], False, gen is not None or not last))
        seen.add(a["session"])
    for sess, (last, _t) in sorted(snap.parked.items()):
        if sess in seen:
            continue
        rows.append(Row(sess, sess, "parked", 0.0, int(last.get("context") or 0), int(last.get("ctx_limit") or 0),
                        int(last.get("generated") or 0), "", "", False, False))
    return rows


def _task_of(a: dict | None) -> str:
    if not a:
        return ""
    return f"{a['task']} {a['step']}/{a['max_steps']}" if a.get("max_steps") else a.get("task", "")


def sort_rows(rows: list[Row], key: str) -> list[Row]:
    def natural(name: str):
        import re
        return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]
    if key == "tok/s":
        return sorted(rows, key=lambda r: (-r.tok_per_s, natural(r.name)))
    if key == "context":
        return sorted(rows, key=lambda r: (-r.context, natural(r.name)))
    if key == "state":
        order = lambda s: 0 if s.startswith(("decoding", "drafting")) else 1 if s.startswith("prefill") else \
            2 if s.startswith("queued") else 3  # noqa: E731
        return sorted(rows, key=lambda r: (order(r.state), natural(r.name)))
    return sorted(rows, key=lambda r: natural(r.name))


# ----------------------------------------------------------------------------------------------- render
def _bytes(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _bar(frac: float, width: int = 8) -> str:
    frac = max(0.0, min(1.0, frac))
    full = int(round(frac * width))
    return "█" * full + "░" * (width - full)


def _state_style(state: str) -> str:
    if state.startswith(("decoding", "drafting")):
        return "green"
    if state.startswith("prefill"):
        return "cyan"
    if state.startswith("queued"):
        return "yellow"
    if state == "solved":
        return "bold green"
    if state in ("error",):
        return "red"
    return "dim"


def _uptime(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def generated_total(snap: Snapshot, m: dict) -> int:
    """Tokens generated so far: the finished requests' (/metrics) plus what the running ones have produced
    (/slots), so the figure moves while requests stream."""
    running = sum(int(q.get("generated") or 0) for q in snap.slots if q.get("state") != "queued")
    return int(metric(m, "generated_tokens_total") or 0) + running


def render(snap: Snapshot, sort: str = "agent", paused: bool = False, show_keys: bool = True):
    parts = [_header(snap), _table(snap, sort), _totals(snap), _gpus(snap)]
    if show_keys:
        keys = Text(f"q quit  s sort ({sort})  p pause", style="dim")
        if paused:
            keys.append("  PAUSED", style="bold yellow")
        parts.append(keys)
    return Group(*parts)


def _header(snap: Snapshot) -> Text:
    """Server, model, uptime, and what is wrong when something is."""
    m = snap.metrics
    head = Text()
    head.append("HiveJet top", style="bold")
    head.append(f"  {snap.url}")
    if snap.model:
        head.append(f"  model {snap.model}")
    if m:
        head.append(f"  up {_uptime(metric(m, 'uptime_seconds') or 0)}")
    if snap.status != "ok" or snap.error:
        head.append(f"  [{snap.status}] {snap.error}", style="red" if snap.status == "down" else "yellow")
    return head


def _table(snap: Snapshot, sort: str) -> Table:
    """One row per conversation or agent."""
    rows = sort_rows(build_rows(snap), sort)
    t = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
    t.add_column("agent", no_wrap=True, max_width=22)
    t.add_column("state", no_wrap=True, min_width=12)
    t.add_column("tok/s", justify="right", no_wrap=True)
    t.add_column("context", no_wrap=True)
    t.add_column("gen", justify="right", no_wrap=True)
    t.add_column("task", no_wrap=True, max_width=22)
    t.add_column("latest output", no_wrap=True, overflow="ellipsis", ratio=1)
    for r in rows:
        lim = r.ctx_limit
        if lim:
            ctx = f"{r.context}/{lim} {_bar(r.context / lim, 6)}"
        else:
            ctx = str(r.context) if r.context else "-"
        gen = (str(r.generated) if r.gen_final else f"≥{r.generated}") if r.generated or r.active else "-"
        # names, tasks and output as plain Text: rich would read "[tool]" or a model's "[/INST]" as markup
        t.add_row(Text(r.name), Text(r.state, style=_state_style(r.state)),
                  f"{r.tok_per_s:.1f}" if r.active else "-", ctx, gen, Text(r.task),
                  Text(r.last_line.replace("\t", " ")))
    if not rows:
        t.add_row("-", Text("idle", style="dim"), "", "", "", "", "no conversations")
    return t


def _totals(snap: Snapshot) -> Text:
    """The server's totals (requests, speed, KV cache, tokens, drafts) and the agents' tally."""
    m = snap.metrics
    tot = Text()
    if m:
        used, cap = metric(m, "kv_tokens_used"), metric(m, "kv_tokens_capacity")
        resident = metric(m, "kv_tokens_resident", None)
        tot.append(f"running {int(metric(m, 'requests_running') or 0)}  queued {int(metric(m, 'requests_queued') or 0)}"
                   f"  {metric(m, 'tokens_per_second') or 0:.1f} tok/s")
        tot.append(f"  KV {int(used or 0)}/{int(cap or 0)} ({100 * (metric(m, 'kv_usage_ratio') or 0):.0f}%)")
        if resident:
            tot.append(f" resident {int(resident)} ({int(metric(m, 'conversations_resident') or 0)} parked)")
        tot.append(f"  generated {generated_total(snap, m)}"
                   f"  prompt {int(metric(m, 'prompt_tokens_total') or 0)}"
                   f"  cached {int(metric(m, 'cached_prompt_tokens_total') or 0)}")
        done = int(metric(m, "requests_finished_total") or 0)
        tot.append(f"  finished {done}")
        proposed = metric(m, "draft_tokens_proposed_total") or 0
        if proposed:
            tot.append(f"  drafts accepted {100 * (metric(m, 'draft_acceptance_ratio') or 0):.0f}%")
    else:
        tot.append("no metrics", style="dim")
    if snap.agents:
        solved = sum(a["solved"] for a in snap.agents)
        fin = sum(a["done"] for a in snap.agents)
        tool_s = sum(a["tool_seconds"] for a in snap.agents)
        tot.append(f"\nagents {len(snap.agents)}  done {fin}  solved {solved}  waiting on tools {tool_s:.1f} s")
    return tot


def _gpus(snap: Snapshot) -> Text:
    """One line per GPU: utilisation, memory, temperature, power."""
    gpu = Text()
    if snap.gpus:
        for i, g in enumerate(snap.gpus):
            if i:
                gpu.append("\n")
            util = "-" if g.get("util_pct") is None else f"{g['util_pct']:.0f}%"
            mem = f"{_bytes(g.get('mem_used'))}/{_bytes(g.get('mem_total'))}"
            temp = "-" if g.get("temp_c") is None else f"{g['temp_c']:.0f}°C"
            power = "-" if g.get("power_w") is None else f"{g['power_w']:.0f} W"
            if g.get("power_limit_w"):
                power += f"/{g['power_limit_w']:.0f} W"
            gpu.append(f"GPU{g.get('index', i)} {g.get('name', '')}".rstrip(), style="bold")
            gpu.append(f"  util {util} {_bar((g.get('util_pct') or 0) / 100, 10)}  mem {mem}  {temp}  {power}")
    else:
        gpu.append(f"GPU: {snap.gpu_note or 'no numbers'}", style="dim")
    return gpu


def frame_text(snap: Snapshot, width: int = 120, sort: str = "agent", paused: bool = False,
               show_keys: bool = True) -> str:
    """The frame as plain text at a fixed width (tests, --once without a terminal)."""
    console = Console(width=width, record=True, force_terminal=False, color_system=None, file=open(os.devnull, "w"),
                      legacy_windows=False, emoji=False)
    console.print(render(snap, sort, paused, show_keys))
    text = console.export_text()
    console.file.close()
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


# ----------------------------------------------------------------------------------------------- polling
def is_local(url: str) -> bool:
    host = (urlparse(url).hostname or "").lower()
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "") or host.startswith("127.")


class Poller:
    """Reads /slots and /metrics (/health until the server is up) and NVML when the server is on this
    machine."""

    def __init__(self, client: Client, agents=None, gpu: bool | None = None):
        self.client = client
        self.agents = agents            # callable -> list[AgentStatus], or None
        self.gpu = is_local(client.url) if gpu is None else gpu
        self.parked: dict = {}
        self.model = ""
        self._need_health = True
        self._gpu_note = ""
        self._gpus_named: dict[int, str] | None = None

    def _gpu_samples(self) -> tuple[list, str]:
        if not self.gpu:
            return [], "not read (the server is on another machine)"
        from app import gpu as G
        if self._gpus_named is None:
            infos, note = G.gpu_status()
            self._gpus_named = {g.index: g.name for g in infos}
            self._gpu_note = note
        out = []
        for i, name in self._gpus_named.items():
            s = G.sample(i)
            if s is not None:
                out.append({**asdict(s), "name": name})
        return out, self._gpu_note

    def poll(self) -> Snapshot:
        """/slots and /metrics; /health only until the server has answered ok (and again after a failure),
        so a refresh is two cheap GETs."""
        snap = Snapshot(url=self.client.url, t=time.time())
        if self._need_health:
            status, info = self.client.health(timeout=2.0)
            snap.status = status
            if status == "ok":
                self.model = info or self.model
                self._need_health = False
            else:
                snap.error = info
        if snap.status == "ok":
            try:
                d = self.client.get_json("/slots", timeout=3.0)
                snap.slots, snap.running, snap.waiting = d.get("slots", []), d.get("running", 0), d.get("waiting", 0)
                snap.metrics_text = self.client.get_text("/metrics", timeout=3.0)
            except ServerError as e:
                self._need_health = True
                snap.status = "loading" if e.status == 503 else "down"
                snap.error = str(e)
        snap.model = self.model
        now = snap.t
        for q in snap.slots:
            if q.get("session") and q.get("state") != "queued":
                self.parked[q["session"]] = (dict(q), now)
        active = {q.get("session") for q in snap.slots}
        self.parked = {s: v for s, v in self.parked.items() if now - v[1] < PARKED_KEEP_S}
        snap.parked = {s: v for s, v in self.parked.items() if s not in active}
        if self.agents is not None:
            snap.agents = [asdict(a) for a in self.agents()]
        snap.gpus, snap.gpu_note = self._gpu_samples()
        return snap


# ----------------------------------------------------------------------------------------------- keys
class KeyReader:
    """Single keys from stdin without Enter (cbreak mode) in a background thread; does nothing when stdin
    is not a terminal. Use as a context manager (restores the terminal)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdin
        self.keys: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._old = None
        self._thread = None
        self.enabled = False

    def __enter__(self):
        try:
            if not self.stream.isatty():
                return self
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            return self
        if os.name == "nt":
            self.enabled = True
            self._thread = threading.Thread(target=self._run_windows, daemon=True)
        else:
            import termios
            import tty
            try:
                self._old = termios.tcgetattr(fd)
                tty.setcbreak(fd)
            except termios.error:
                return self
            self.enabled = True
            self._thread = threading.Thread(target=self._run_posix, args=(fd,), daemon=True)
        self._thread.start()
        return self

    def _run_posix(self, fd):
        while not self._stop.is_set():
            try:
                r, _, _ = select.select([fd], [], [], 0.1)
                if r:
                    ch = os.read(fd, 1).decode("utf-8", "replace")
                    if not ch:
                        return
                    with self._lock:
                        self.keys.append(ch)
            except OSError:
                return

    def _run_windows(self):
        import msvcrt
        while not self._stop.is_set():
            if msvcrt.kbhit():
                with self._lock:
                    self.keys.append(msvcrt.getwch())
            else:
                time.sleep(0.05)

    def get(self) -> list[str]:
        with self._lock:
            k, self.keys = self.keys, []
        return k

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(0.5)
        if self._old is not None:
            import termios
            termios.tcsetattr(self.stream.fileno(), termios.TCSADRAIN, self._old)


class TopScreen:
    """The live screen: polls every `interval` seconds and handles keys until quit() or `until()` is true."""

    def __init__(self, poller: Poller, interval: float = 0.25, console: Console | None = None, sort: str = "agent"):
        self.poller, self.interval = poller, interval
        self.console = console or Console()
        self.sort = sort if sort in SORTS else "agent"
        self.paused = False
        self.quit_requested = False
        self.interrupted: KeyboardInterrupt | None = None   # Ctrl-C (or SIGTERM, app/top's Terminated) ended it
        self.last: Snapshot | None = None

    def handle_key(self, k: str) -> None:
        k = k.lower()
        if k == "q":
            self.quit_requested = True
        elif k == "\x03":          # Ctrl-C read as a key (no SIGINT): an interrupt all the same
            self.quit_requested = True
            self.interrupted = KeyboardInterrupt()
        elif k == "s":
            self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        elif k == "p":
            self.paused = not self.paused

    def run(self, until=None, keys: KeyReader | None = None) -> Snapshot | None:
        from rich.live import Live
        self.last = self.poller.poll()
        with Live(render(self.last, self.sort, self.paused), console=self.console, auto_refresh=False,
                  screen=self.console.is_terminal, redirect_stdout=False, redirect_stderr=False,
                  transient=False) as live:
            try:
                while not self.quit_requested:
                    t0 = time.monotonic()
                    for k in (keys.get() if keys else []):
                        self.handle_key(k)
                    if until is not None and until():
                        break
                    if not self.paused:
                        self.last = self.poller.poll()
                    live.update(render(self.last, self.sort, self.paused), refresh=True)
                    time.sleep(max(0.02, self.interval - (time.monotonic() - t0)))
            except KeyboardInterrupt as e:
                self.quit_requested = True
                self.interrupted = e
            if until is not None and until() and not self.paused:
                self.last = self.poller.poll()
                live.update(render(self.last, self.sort, self.paused), refresh=True)
        return self.last
