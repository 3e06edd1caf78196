"""Constrained decoding for the server: JSON schema / JSON object / Lark grammars through llguidance.

`GrammarConstraint` implements the engine's TokenConstraint protocol (engine/types.py): `mask(logits)` sets
every token the grammar forbids next to -inf, `accept(token)` advances the matcher, `is_done()` is true once
the grammar can take nothing more. llguidance needs the vocabulary as bytes (llama.cpp's token pieces, control
tokens marked with a leading 0xFF) and the end-of-generation ids; that tokenizer is built once per engine
tokenizer and cached.
"""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import torch

__all__ = ["GrammarError", "GrammarConstraint", "json_schema_grammar", "lark_grammar", "ll_tokenizer"]


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled (maps to HTTP 400)."""


_CACHE: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_ATTR_CONTROL = 1 << 3  # engine.tokenizer ATTR_CONTROL (llama.cpp LLAMA_TOKEN_ATTR_CONTROL)
_ATTR_USER_DEFINED = 1 << 4


class _VocabWrapper:
    """What llguidance.TokenizerWrapper expects of a tokenizer."""

    def __init__(self, tok):
        from engine import tokenizer as tk
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids or {0})
        self.bos_token_id = tok.bos_id
        ctrl = getattr(tk, "ATTR_CONTROL", _ATTR_CONTROL)
        user = getattr(tk, "ATTR_USER_DEFINED", _ATTR_USER_DEFINED)
        tokens, special = [], []
        for i in range(tok.vocab_size):
            b = tok.token_bytes(i)
            attr = tok.token_attr(i)
            if attr & ctrl or (attr & user and b.startswith(b"<") and b.endswith(b">")):
                b = b"\xff" + b
                special.append(i)
            tokens.append(b)
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, s):
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special=False, parse_special=False)


def ll_tokenizer(tok):
    """The llguidance LLTokenizer for an engine Tokenizer (built once, ~0.1-1 s)."""
    import llguidance
    with _LOCK:
        llt = _CACHE.get(tok)
        if llt is None:
            wrapper = llguidance.TokenizerWrapper(_VocabWrapper(tok))
            eog = sorted(tok.eog_ids) or [wrapper.eos_token_id]
            llt = llguidance.LLTokenizer(wrapper, n_vocab=tok.vocab_size, eos_token=eog)
            _CACHE[tok] = llt
        return llt


_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict | bool | None) -> str:
    """An llguidance grammar for JSON matching `schema` (None: any JSON object). Compact separators, no free
    whitespace: a small model cannot wander off into endless newlines."""
    import llguidance
    if schema is None or schema is True or schema == {}:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def lark_grammar(lark: str) -> str:
    import llguidance
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_grammar(tok, grammar: str) -> None:
    """Raise GrammarError if llguidance rejects the grammar."""
    import llguidance
    err = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tok))
    if err and not err.startswith("WARNING"):
        raise GrammarError(f"invalid grammar or schema: {err}")


class GrammarConstraint:
    """TokenConstraint over an llguidance grammar."""

    def __init__(self, tok, grammar: str):
        import llguidance
        check_grammar(tok, grammar)
        self._llt = ll_tokenizer(tok)
        self.matcher = llguidance.LLMatcher(self._llt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid grammar or schema: {self.matcher.get_error()}")
        self.vocab_size = tok.vocab_size
        self._bits = torch.arange(32, dtype=torch.int32)
        self.eog_ids = sorted(tok.eog_ids)

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next."""
        raw = self.matcher.compute_bitmask()
        words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
        bits = ((words.unsqueeze(1) >> self._bits) & 1).reshape(-1).bool()
        return bits[: self.vocab_size]

    def mask(self, logits) -> None:
        if self.matcher.is_error():
            # Never leave a row with nothing samplable: allow only end-of-generation.
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
            keep[self.eog_ids] = True
        else:
            allowed = self.allowed()
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
            n = min(allowed.shape[0], keep.shape[0])
            keep[:n] = allowed[:n]
        logits.masked_fill_(~keep.to(logits.device), float("-inf"))

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(int(token_id))

    def is_done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()
