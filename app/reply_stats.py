"""One line of a finished reply's figures (tokens, decode tok/s, time to first token), shown under each
reply by the terminal chat and the desktop chat."""
from __future__ import annotations


def reply_stats(fin) -> str:
    """`fin` is the engine's FinishEvent (or anything with .usage.completion_tokens and .timings)."""
    n = fin.usage.completion_tokens
    parts = [f"{n} token" + ("" if n == 1 else "s")]
    t = fin.timings
    if t.decode_tokens_per_s:
        parts.append(f"{t.decode_tokens_per_s:.1f} tok/s")
    if t.prompt_ms:
        parts.append(f"first token {t.prompt_ms / 1000:.2f} s")
    return " · ".join(parts)
