"""Prometheus metrics (text exposition format 0.0.4), written by hand: the server's own counters plus what
engine.stats() says now."""
from __future__ import annotations

import threading
import time
from collections import Counter


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = Counter()          # (route, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.finished_by_reason = Counter()
        self.decode_seconds = 0.0
        self.started = time.time()

    def request_done(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def finished(self, fin) -> None:
        with self._lock:
            self.prompt_tokens += fin.usage.prompt_tokens
            self.generated_tokens += fin.usage.completion_tokens
            self.cached_tokens += fin.usage.cached_tokens
            self.finished_by_reason[fin.reason] += 1
            self.decode_seconds += fin.timings.decode_ms / 1000.0

    def render(self, stats: dict | None) -> str:
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP hivejet_{name} {help_}")
            lines.append(f"# TYPE hivejet_{name} {kind}")
            for labels, v in samples:
                lab = "{" + ",".join(f'{k}="{_esc(val)}"' for k, val in labels.items()) + "}" if labels else ""
                lines.append(f"hivejet_{name}{lab} {float(v):.6g}" if isinstance(v, float) else f"hivejet_{name}{lab} {v}")

        with self._lock:
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, self.prompt_tokens)])
            metric("generated_tokens_total", "counter", "Generated tokens of finished requests.",
                   [({}, self.generated_tokens)])
            metric("cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
                   [({}, self.cached_tokens)])
            metric("requests_finished_total", "counter", "Generation requests finished, by reason.",
                   [({"reason": r}, n) for r, n in sorted(self.finished_by_reason.items())] or [({"reason": "stop"}, 0)])
            metric("http_requests_total", "counter", "HTTP requests answered, by route and status.",
                   [({"route": r, "status": str(s)}, n) for (r, s), n in sorted(self.requests.items())])
        s = stats or {}
        seqs = s.get("sequences", [])
        running = [q for q in seqs if q.get("state") != "queued"]
        tok_s = sum(q.get("tok_per_s", 0.0) for q in running)
        metric("tokens_per_second", "gauge", "Generation speed summed over running sequences (last seconds).",
               [({}, float(tok_s))])
        metric("requests_running", "gauge", "Sequences the engine is running.", [({}, s.get("running", 0))])
        metric("requests_queued", "gauge", "Requests waiting for a free sequence.", [({}, s.get("waiting", 0))])
        ctx = s.get("ctx_size", 0) or 0
        used = sum(q.get("context", 0) for q in running)
        pool = s.get("kv_pool") or {}
        capacity = pool.get("capacity_tokens") or ctx * max(len(running), 1)
        used = pool.get("used_tokens", used)
        metric("kv_tokens_used", "gauge", "KV cache tokens in use.", [({}, used)])
        metric("kv_tokens_capacity", "gauge", "KV cache tokens available.", [({}, capacity)])
        metric("kv_usage_ratio", "gauge", "KV cache use (0..1).", [({}, float(used / capacity) if capacity else 0.0)])
        res = s.get("resident") or {}
        metric("kv_tokens_resident", "gauge", "KV cache tokens that parked conversations keep for their next turn "
                                              "(part of kv_tokens_used).", [({}, int(res.get("tokens") or 0))])
        metric("conversations_resident", "gauge", "Parked conversations whose KV cache is kept.",
               [({}, int(res.get("conversations") or 0))])
        ck = pool.get("state_checkpoints")
        if ck:   # (models with recurrent layers on the GPU path)
            where = {"memory": ck["memory"]}
            metric("state_checkpoints", "gauge", "Recurrent-state checkpoints kept, by where they live.",
                   [(where, ck["kept"])])
            metric("state_checkpoint_bytes", "gauge", "Memory the recurrent-state checkpoints' buffers take.",
                   [(where, ck["bytes"])])
            metric("state_checkpoints_evicted_total", "counter", "Recurrent-state checkpoints evicted.",
                   [({}, ck["evicted"])])
        totals = s.get("totals", {})
        proposed = totals.get("drafted_tokens", 0)       # (engine.stats()'s totals)
        accepted = totals.get("accepted_tokens", 0)
        by = (s.get("spec") or {}).get("drafters") or {}
        metric("draft_tokens_proposed_total", "counter", "Draft tokens proposed by speculative decoding.",
               [({}, proposed)])
        metric("draft_tokens_accepted_total", "counter", "Draft tokens accepted.", [({}, accepted)])
        metric("draft_acceptance_ratio", "gauge", "Accepted / proposed draft tokens.",
               [({}, float(accepted / proposed) if proposed else 0.0)])
        if by:   # per drafter (ngram, mtp, dflash), as their own families: the totals above stay one sample
            metric("drafter_tokens_proposed_total", "counter", "Draft tokens proposed, by drafter.",
                   [({"drafter": d}, v["drafted"]) for d, v in sorted(by.items())])
            metric("drafter_tokens_accepted_total", "counter", "Draft tokens accepted, by drafter.",
                   [({"drafter": d}, v["accepted"]) for d, v in sorted(by.items())])
        metric("engine_steps_total", "counter", "Engine steps run.", [({}, totals.get("steps", 0))])
        metric("uptime_seconds", "gauge", "Seconds since the server started.", [({}, float(time.time() - self.started))])
        return "\n".join(lines) + "\n"


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
