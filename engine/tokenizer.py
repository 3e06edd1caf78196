"""Tokenizer built from GGUF metadata that reproduces llama.cpp's token ids exactly.

This is a port of llama.cpp's `src/llama-vocab.cpp` and `src/unicode.cpp` (the ggml-org master of
the b11xxx era), restricted to the two vocabulary types real chat models use:

* ``tokenizer.ggml.model == "gpt2"`` (LLAMA_VOCAB_TYPE_BPE): byte-level BPE. The text is split on
  special tokens, every fragment is pre-tokenized with the regex list llama.cpp assigns to
  ``tokenizer.ggml.pre`` (see `_PRE_TYPES` / `_PRE_REGEXES`), every pre-token is mapped through the
  GPT-2 byte->unicode table and merged with the merge ranks (lowest rank first, leftmost first).
  ``tokenizer.ggml.model == "gemma4"`` (SPM-style BPE on raw UTF-8 with ``<0xXX>`` byte tokens) is
  supported the same way.
* ``tokenizer.ggml.model == "llama"`` (LLAMA_VOCAB_TYPE_SPM): SentencePiece-style. Spaces become
  U+2581, a space is prefixed to a fragment that follows BOS/a special token when
  ``add_space_prefix`` is set, then bigrams are merged by score (highest first, leftmost first) and
  symbols that are not in the vocabulary fall back to ``<0xXX>`` byte tokens.

How llama.cpp pre-tokenizes, and how this module reproduces it
---------------------------------------------------------------
llama.cpp does not run the pre-tokenizer regexes with a Unicode regex engine. For the common
patterns (gpt2, llama3, qwen2, qwen35, kimi-k2, the afmoe/tiny_aya digit splitter, newline runs) it
has hand-written scanners (``unicode_regex_split_custom_*``); those are ported here line by line.
Every other pattern goes through ``std::regex`` (ECMAScript) on a "collapsed" text in which every
non-ASCII code point is replaced by one byte standing for its category (0xD1 number, 0xD2 letter,
0xD3 punctuation, 0xD4 mark, 0xD5 symbol, 0xD0 other, 0x0B whitespace) and ``\\p{X}`` in the
pattern by that byte plus the ASCII members of the category; patterns without ``\\p{..}`` run with
``std::wregex`` on the code points (non-ASCII whitespace replaced by 0x0B). Both are emulated with
the ``regex`` module in ASCII mode (so ``\\s``, ``\\d``, ``\\w`` mean what ECMAScript gives them).

Known deviations from llama.cpp
-------------------------------
* Unicode character categories come from the ``regex`` module's tables, llama.cpp's from its
  generated ``unicode-data.cpp``; the Unicode versions may differ for recently added characters.
* llama.cpp orders special tokens of equal byte length with ``std::sort`` (unspecified order); here
  ties are broken by token id. It only matters when two equal-length special tokens overlap in the
  text.
* Where llama.cpp picks "the first" token by iterating an ``unordered_map`` (auto-detected EOT/FIM
  tokens when several candidates exist), the lowest id is taken.
* Input strings with lone surrogates are sanitized to U+FFFD first (llama.cpp receives bytes).
* Duplicate token texts (possible only because the GGUF reader decodes invalid UTF-8 token bytes
  with replacement characters) keep the first id; llama.cpp would refuse such a vocabulary.
* WPM (bert), UGM (t5), RWKV and PLaMo-2 vocabularies are not supported (ValueError).

Decoding follows ``llama_detokenize(remove_special=false, unparse_special=not skip_special)``:
pieces are ``token_to_piece`` (BPE: unicode chars mapped back to bytes; SPM: U+2581 -> space and
``<0xXX>`` -> the byte; control/unknown tokens render as their text unless skipped; user-defined
tokens always render as their text; unused/undefined tokens render as nothing), the first piece
loses one leading space when ``add_space_prefix`` is set (as in llama.cpp, a leading BOS consumes
that strip), and llama.cpp's ``clean_spaces`` post-processing is applied for the vocabularies that
enable it (e.g. pre ``default``/``gpt-2``/``llama3``; not smollm, qwen2, or SPM). The result is
decoded as UTF-8 with invalid bytes replaced. `StreamDecoder` emits the same pieces incrementally
but never applies ``clean_spaces`` (llama.cpp's streaming output does not either); for vocabularies
without ``clean_spaces`` its concatenated output equals `Tokenizer.decode`.
"""
from __future__ import annotations

import codecs
import collections
import heapq
import threading
from typing import Iterable

import regex

__all__ = ["Tokenizer", "StreamDecoder", "pre_tokenize_regexes", "split_pre_tokens"]

# --------------------------------------------------------------------------------------------
# token types (GGUF tokenizer.ggml.token_type) and llama.cpp token attributes
# --------------------------------------------------------------------------------------------
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
    TOKEN_TYPE_UNDEFINED: ATTR_UNDEFINED,
}

# --------------------------------------------------------------------------------------------
# code point flags (llama.cpp unicode_cpt_flags)
# --------------------------------------------------------------------------------------------
F_UNDEFINED = 0x0001
F_NUMBER = 0x0002
F_LETTER = 0x0004
F_SEPARATOR = 0x0008
F_MARK = 0x0010
F_PUNCT = 0x0020
F_SYMBOL = 0x0040
F_CONTROL = 0x0080
F_CATEGORIES = 0x00FF
F_WHITESPACE = 0x0100

# Unicode White_Space property (PropList.txt), what llama.cpp's unicode_set_whitespace holds.
_WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
     0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

_CATEGORY_RE = regex.compile(
    r"(\p{L})|(\p{N})|(\p{M})|(\p{P})|(\p{S})|(\p{Z})|(\p{Cn})|(\p{C})", regex.DOTALL)
_GROUP_FLAG = (0, F_LETTER, F_NUMBER, F_MARK, F_PUNCT, F_SYMBOL, F_SEPARATOR, F_UNDEFINED, F_CONTROL)

_FLAGS_CACHE: dict[str, int] = {}


def _flags_of(ch: str) -> int:
    f = _FLAGS_CACHE.get(ch)
    if f is None:
        m = _CATEGORY_RE.match(ch)
        f = _GROUP_FLAG[m.lastindex] if m else F_UNDEFINED
        if ord(ch) in _WHITESPACE:
            f |= F_WHITESPACE
        _FLAGS_CACHE[ch] = f
    return f


def _flags_list(text: str) -> list[int]:
    get = _FLAGS_CACHE.get
    out = [get(c) for c in text]
    if None in out:
        out = [_flags_of(c) for c in text]
    return out


for _c in range(128):  # warm the cache with ASCII
    _flags_of(chr(_c))

_F_WLN = F_WHITESPACE | F_LETTER | F_NUMBER
_F_WLMN = F_WHITESPACE | F_LETTER | F_MARK | F_NUMBER
_F_LM = F_LETTER | F_MARK
_CONTRACTION1 = frozenset("stmd")
_CONTRACTION2 = frozenset(["re", "ve", "ll"])
_RN = ("\r", "\n")
_OOR = ""  # "out of range" sentinel code point


def _lower_ascii(c: str) -> str:
    return c.lower() if "A" <= c <= "Z" else c


def _is_han(c: str) -> bool:
    if not c:
        return False
    cp = ord(c)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0x2CEB0 <= cp <= 0x2EBEF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _fragments(text: str, flags: list[int], offsets: list[int]):
    """Yield (chars, flags, length) per offset, both padded so that reads past the end see the
    "out of range" code point and empty flags, like llama.cpp's _get_cpt/_get_flags."""
    start = 0
    for off in offsets:
        end = start + off
        s = list(text[start:end])
        s.extend((_OOR, _OOR, _OOR))
        f = flags[start:end]
        f.extend((0, 0, 0))
        yield s, f, off
        start = end


# ---- custom splitters (ports of unicode_regex_split_custom_*) --------------------------------

def _split_gpt2(text, flags, offsets):
    out = []
    for s, fl, L in _fragments(text, flags, offsets):
        pos = 0
        while pos < L:
            c = s[pos]
            f = fl[pos]
            # 's|'t|'re|'ve|'m|'ll|'d
            if c == "'" and pos + 1 < L:
                c1 = s[pos + 1]
                if c1 in _CONTRACTION1:
                    out.append(2)
                    pos += 2
                    continue
                if pos + 2 < L and c1 + s[pos + 2] in _CONTRACTION2:
                    out.append(3)
                    pos += 3
                    continue
            sp = c == " "
            f2 = fl[pos + 1] if sp else f
            start = pos
            if f2 & F_LETTER:  # <space>?\p{L}+
                pos += sp
                while fl[pos] & F_LETTER:
                    pos += 1
            elif f2 & F_NUMBER:  # <space>?\p{N}+
                pos += sp
                while fl[pos] & F_NUMBER:
                    pos += 1
            elif not (f2 & _F_WLN) and f2:  # <space>?[^\s\p{L}\p{N}]+
                pos += sp
                while True:
                    f2 = fl[pos]
                    if (f2 & _F_WLN) or not f2:
                        break
                    pos += 1
            else:
                n = 0
                while fl[pos + n] & F_WHITESPACE:
                    n += 1
                if n > 1 and pos + n < L:  # \s+(?!\S)
                    pos += n - 1
                elif n > 0:  # \s+
                    pos += n
                else:
                    pos += 1
            if pos > start:
                out.append(pos - start)
    return out


def _split_llama3_like(text, flags, offsets, digits_max, with_marks):
    """llama3 (digits_max=3), qwen2 (digits_max=1) and qwen35 (digits_max=1, with_marks)."""
    out = []
    f_word = _F_LM if with_marks else F_LETTER
    f_not_punct = _F_WLMN if with_marks else _F_WLN
    for s, fl, L in _fragments(text, flags, offsets):
        pos = 0
        while pos < L:
            c = s[pos]
            f = fl[pos]
            # (?i:'s|'t|'re|'ve|'m|'ll|'d)
            if c == "'" and pos + 1 < L:
                c1 = _lower_ascii(s[pos + 1])
                if c1 in _CONTRACTION1:
                    out.append(2)
                    pos += 2
                    continue
                if pos + 2 < L and c1 + _lower_ascii(s[pos + 2]) in _CONTRACTION2:
                    out.append(3)
                    pos += 3
                    continue
            start = pos
            # [^\r\n\p{L}\p{N}]?\p{L}+   (qwen35: [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+)
            if not (c == "\r" or c == "\n" or f & F_NUMBER):
                if f & f_word or fl[pos + 1] & f_word:
                    pos += 1
                    while fl[pos] & f_word:
                        pos += 1
                    out.append(pos - start)
                    continue
            # \p{N}{1,3} / \p{N}
            if f & F_NUMBER:
                if digits_max == 1:
                    out.append(1)
                    pos += 1
                    continue
                ini = pos
                while fl[pos] & F_NUMBER:
                    pos += 1
                    if pos - ini >= digits_max:
                        out.append(pos - ini)
                        ini = pos
                if pos > ini:
                    out.append(pos - ini)
                continue
            # <space>?[^\s\p{L}\p{N}]+[\r\n]*
            sp = c == " "
            f2 = fl[pos + 1] if sp else f
            if not (f2 & f_not_punct) and f:
                pos += sp
                while True:
                    f2 = fl[pos]
                    if (f2 & f_not_punct) or not f2:
                        break
                    pos += 1
                while s[pos] in _RN and s[pos]:
                    pos += 1
                if pos > start:
                    out.append(pos - start)
                continue
            n = 0
            last_rn = 0
            while fl[pos + n] & F_WHITESPACE:
                if s[pos + n] in _RN:
                    last_rn = pos + n + 1
                n += 1
            if last_rn > 0:  # \s*[\r\n]+
                pos = last_rn
            elif n > 1 and pos + n < L:  # \s+(?!\S)
                pos += n - 1
            elif n > 0:  # \s+
                pos += n
            else:
                pos += 1
            if pos > start:
                out.append(pos - start)
    return out


def _split_llama3(text, flags, offsets):
    return _split_llama3_like(text, flags, offsets, 3, False)


def _split_qwen2(text, flags, offsets):
    return _split_llama3_like(text, flags, offsets, 1, False)


def _split_qwen35(text, flags, offsets):
    return _split_llama3_like(text, flags, offsets, 1, True)


def _split_kimi_k2(text, flags, offsets):
    out = []
    for s, fl, L in _fragments(text, flags, offsets):
        pos = 0
        while pos < L:
            c = s[pos]
            f = fl[pos]
            start = pos
            # [\p{Han}]+
            if _is_han(c):
                while _is_han(s[pos]):
                    pos += 1
                out.append(pos - start)
                continue
            is_letter_pattern = (f & F_LETTER and not _is_han(c)) or (
                not (c == "\r" or c == "\n" or f & (F_LETTER | F_NUMBER))
                and fl[pos + 1] & F_LETTER and not _is_han(s[pos + 1]))
            if is_letter_pattern:
                has_leading = False
                if not (c == "\r" or c == "\n" or f & (F_LETTER | F_NUMBER)):
                    has_leading = True
                    pos += 1
                has_letters = False
                while fl[pos] & F_LETTER and not _is_han(s[pos]):
                    has_letters = True
                    pos += 1
                if has_letters or (not has_leading and fl[pos] & F_LETTER and not _is_han(s[pos])):
                    if not has_letters:
                        pos += 1
                    while fl[pos] & F_LETTER and not _is_han(s[pos]):
                        pos += 1
                    if s[pos] == "'" and pos + 1 < L:
                        c1 = _lower_ascii(s[pos + 1])
                        if c1 in _CONTRACTION1:
                            pos += 2
                        elif pos + 2 < L and c1 + _lower_ascii(s[pos + 2]) in _CONTRACTION2:
                            pos += 3
                    out.append(pos - start)
                    continue
                elif has_leading:
                    pos -= 1
            # \p{N}{1,3}
            if f & F_NUMBER:
                ini = pos
                while fl[pos] & F_NUMBER:
                    pos += 1
                    if pos - ini >= 3:
                        out.append(pos - ini)
                        ini = pos
                if pos > ini:
                    out.append(pos - ini)
                continue
            #  ?[^\s\p{L}\p{N}]+[\r\n]*
            sp = c == " "
            f2 = fl[pos + 1] if sp else f
            if not (f2 & _F_WLN) and f2:
                pos += sp
                while True:
                    f2 = fl[pos]
                    if (f2 & _F_WLN) or not f2:
                        break
                    pos += 1
                while s[pos] in _RN and s[pos]:
                    pos += 1
                out.append(pos - start)
                continue
            n = 0
            last_rn = 0
            while fl[pos + n] & F_WHITESPACE:
                if s[pos + n] in _RN:
                    last_rn = pos + n + 1
                n += 1
            if last_rn > 0:
                pos = last_rn
            elif n > 1 and pos + n < L:
                pos += n - 1
            elif n > 0:
                pos += n
            else:
                pos += 1
            if pos > start:
                out.append(pos - start)
    return out


def _split_digit_groups(text, flags, offsets):
    """unicode_regex_split_custom_afmoe (also used for tiny_aya's digit pattern)."""
    out = []
    for _s, fl, L in _fragments(text, flags, offsets):
        prev = 0
        pos = 0
        while pos < L:
            if fl[pos] & F_NUMBER:
                dstart = pos
                while fl[pos] & F_NUMBER and pos < L:
                    pos += 1
                count = pos - dstart
                rem = count % 3
                cur = dstart
                if rem > 0:
                    if cur + rem > prev:
                        out.append(cur + rem - prev)
                    prev = cur + rem
                    cur += rem
                while cur < dstart + count:
                    if cur + 3 > prev:
                        out.append(cur + 3 - prev)
                    prev = cur + 3
                    cur += 3
                continue
            pos += 1
        if prev < L:
            out.append(L - prev)
    return out


def _split_newlines(text, flags, offsets):
    out = []
    start = 0
    for off in offsets:
        end = start + off
        pos = start
        while pos < end:
            nl = text[pos] == "\n"
            run = pos
            while pos < end and (text[pos] == "\n") == nl:
                pos += 1
            out.append(pos - run)
        start = end
    return out


# --------------------------------------------------------------------------------------------
# pre-tokenizer regexes, transcribed from llm_tokenizer_bpe's constructor (C string values)
# --------------------------------------------------------------------------------------------
_RE_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_RE_LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
              "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_LLAMA3_ORIG = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_QWEN2 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
             "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_QWEN35 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+"
              "|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_CONTRACT = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_JAIS2 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
             "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)"
             "|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)"
             "|\\s{1,2}(?!\\S)|\\s{1}")
_RE_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+")
_RE_DEEPSEEK3_MAIN = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                      "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_RE_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_RE_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_RE_TEKKEN = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?"
              "((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
              "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_GPT4O = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _RE_CONTRACT + "?"
             "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _RE_CONTRACT + "?"
             "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_GRANITE_EMB_MULTI = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+" + _RE_CONTRACT + "?"
    "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*" + _RE_CONTRACT + "?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_RE_CASED_WORDS = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+" + _RE_CONTRACT + "?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" + _RE_CONTRACT + "?")
_RE_TINY_AYA = _RE_CASED_WORDS + "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_RE_YOUTU = _RE_CASED_WORDS + "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_RE_NEWLINE_RUNS = "[^\\n]+|[\\n]+"
_RE_TINY_AYA_DIGITS = "\\d{1,3}(?=(?:\\d{3})*\\b)"

_PRE_REGEXES: dict[str, list[str]] = {
    "LLAMA3": [_RE_LLAMA3],
    "JAIS2": [_RE_JAIS2],
    "DBRX": [_RE_LLAMA3],
    "SMAUG": [_RE_LLAMA3],
    "DEEPSEEK_LLM": [
        "[\r\n]",
        _RE_DEEPSEEK_LLM_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ],
    "DEEPSEEK3_LLM": ["\\p{N}{1,3}", _RE_CJK_KANA, _RE_DEEPSEEK3_MAIN],
    "SPARK2_5": [
        "\\p{N}{1,3}",
        _RE_CJK_KANA,
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
        "\\p{N}",
    ],
    "YOUTU": [
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
        "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        _RE_YOUTU,
    ],
    "DEEPSEEK_CODER": ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                       "\\p{N}"],
    "FALCON": ["[\\p{P}\\$\\+<=>\\^~\\|`]+", _RE_GPT2, "[0-9][0-9][0-9]"],
    "STARCODER": ["\\p{N}", _RE_GPT2],
    "GPT2": [_RE_GPT2],
    "QWEN2": [_RE_QWEN2],
    "QWEN35": [_RE_QWEN35],
    "PORO": [_RE_PORO],
    "CHATGLM4": [_RE_LLAMA3],
    "VIKING": [_RE_PORO, "\\p{N}"],
    "TEKKEN": [_RE_TEKKEN],
    "CHAMELEON": [
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        "\\p{N}",
        "[\\p{P}!-/:-@\\[-`{-~]",
        _RE_GPT2,
    ],
    "GPT4O": [_RE_GPT4O],
    "GRANITE_EMB_MULTI": [_RE_GRANITE_EMB_MULTI],
    "TINY_AYA": [_RE_TINY_AYA_DIGITS, _RE_TINY_AYA],
    "KIMI_K2": ["\\p{Han}+"],
    "SUPERBPE": ["\\p{N}+", "(?=(\\d{3})+(?!\\d))"],
    "BAILINGMOE": ["'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"],
    "SEED_CODER": [_RE_CONTRACT + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+"
                   "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "UFAKZEKA": ["[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "GROK_2": [_RE_QWEN2],
    "AFMOE": [
        "\\p{AFMoE_digits}",
        "[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
        "\u0e00-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
        "\u1100-\u11ff]+",
        _RE_DEEPSEEK3_MAIN.replace("\r\n", "\\r\\n"),
    ],
    "LAGUNA": [_RE_NEWLINE_RUNS, _RE_QWEN2],
    "EXAONE_MOE": [_RE_CONTRACT + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"],
    "GEMMA4": [_RE_NEWLINE_RUNS],
    "SARVAM_MOE": [_RE_NEWLINE_RUNS],
    "MINICPM5": ["\\p{N}{1,3}", _RE_CONTRACT + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "DEFAULT": ["[\\p{P}\\$\\+<=>\\^~\\|]+", _RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"],
}
for _t in ("REFACT", "COMMAND_R", "SMOLLM", "CODESHELL", "EXAONE", "MINERVA", "MELLUM2"):
    _PRE_REGEXES[_t] = _PRE_REGEXES["STARCODER"]
for _t in ("MPT", "OLMO", "JAIS", "TRILLION", "GRANITE_DOCLING"):
    _PRE_REGEXES[_t] = _PRE_REGEXES["GPT2"]
for _t in ("STABLELM2", "HUNYUAN", "SOLAR_OPEN"):
    _PRE_REGEXES[_t] = _PRE_REGEXES["QWEN2"]
for _t in ("HUNYUAN_DENSE", "JOYAI_LLM", "HY_V4"):
    _PRE_REGEXES[_t] = _PRE_REGEXES["DEEPSEEK3_LLM"]
_PRE_REGEXES["MINIMAX_M2"] = _PRE_REGEXES["GPT4O"]
_PRE_REGEXES["BLOOM"] = _PRE_REGEXES["GPT3_FINNISH"] = _PRE_REGEXES["PORO"]

# tokenizer.ggml.pre -> (pre type, options) as in llama_vocab::impl::load
_PRE_TYPES: dict[str, tuple[str, dict]] = {}


def _pre(names, ptype, **opts):
    for n in names:
        _PRE_TYPES[n] = (ptype, opts)


_NOCLEAN = {"clean_spaces": False}
_pre(["default"], "DEFAULT")
_pre(["minicpm5"], "MINICPM5", ignore_merges=True)
_pre(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
     "LLAMA3", ignore_merges=True, add_bos=True)
_pre(["deepseek-llm"], "DEEPSEEK_LLM", **_NOCLEAN)
_pre(["deepseek-coder"], "DEEPSEEK_CODER", **_NOCLEAN)
_pre(["deepseek-v3"], "DEEPSEEK3_LLM", **_NOCLEAN)
_pre(["spark2_5"], "SPARK2_5", **_NOCLEAN)
_pre(["youtu"], "YOUTU", clean_spaces=False, ignore_merges=True)
_pre(["falcon"], "FALCON")
_pre(["mpt"], "MPT")
_pre(["starcoder"], "STARCODER")
_pre(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "exaone4"], "GPT2")
_pre(["jais-2"], "JAIS2")
_pre(["gemma4", "granite-embed-multi-311m"], "GEMMA4", escape_whitespaces=True)
_pre(["sarvam-moe"], "SARVAM_MOE", escape_whitespaces=True, clean_spaces=False)
_pre(["jina-v1-en", "jina-v2-code", "roberta-bpe"], "GPT2", add_sep=True)
_pre(["refact"], "REFACT")
_pre(["command-r"], "COMMAND_R", **_NOCLEAN)
_pre(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], "QWEN2", **_NOCLEAN)
_pre(["qwen35"], "QWEN35", **_NOCLEAN)
_pre(["stablelm2"], "STABLELM2")
_pre(["olmo"], "OLMO")
_pre(["dbrx"], "DBRX")
_pre(["smaug-bpe"], "SMAUG")
_pre(["poro-chat"], "PORO", **_NOCLEAN)
_pre(["glm4", "chatglm-bpe"], "CHATGLM4", bos_null=True)
_pre(["viking"], "VIKING", **_NOCLEAN)
_pre(["jais"], "JAIS")
_pre(["tekken"], "TEKKEN", clean_spaces=False, ignore_merges=True, add_bos=True)
_pre(["smollm"], "SMOLLM", **_NOCLEAN)
_pre(["codeshell"], "CODESHELL")
_pre(["bloom"], "BLOOM")
_pre(["gpt3-finnish"], "GPT3_FINNISH")
_pre(["exaone"], "EXAONE")
_pre(["exaone-moe"], "EXAONE_MOE")
_pre(["chameleon"], "CHAMELEON", add_bos=True, clean_spaces=False)
_pre(["minerva-7b"], "MINERVA")
_pre(["megrez"], "QWEN2")
_pre(["gpt-4o", "llama4", "kanana2", "talkie"], "GPT4O", **_NOCLEAN)
_pre(["granite-embed-multi-97m"], "GRANITE_EMB_MULTI", clean_spaces=False, ignore_merges=True)
_pre(["tiny_aya", "cohere2moe"], "TINY_AYA", **_NOCLEAN)
_pre(["superbpe"], "SUPERBPE", **_NOCLEAN)
_pre(["trillion"], "TRILLION", **_NOCLEAN)
_pre(["granite-docling"], "GRANITE_DOCLING", **_NOCLEAN)
_pre(["bailingmoe", "bailingmoe2", "llada-moe"], "BAILINGMOE", **_NOCLEAN)
_pre(["seed-coder"], "SEED_CODER", **_NOCLEAN)
_pre(["hunyuan"], "HUNYUAN", **_NOCLEAN)
_pre(["hunyuan-dense"], "HUNYUAN_DENSE", **_NOCLEAN)
_pre(["hy_v4"], "HY_V4", **_NOCLEAN)
_pre(["joyai-llm"], "JOYAI_LLM", **_NOCLEAN)
_pre(["kimi-k2"], "KIMI_K2", **_NOCLEAN)
_pre(["ufakzeka"], "UFAKZEKA", **_NOCLEAN)
_pre(["grok-2"], "GROK_2", **_NOCLEAN)
_pre(["afmoe"], "AFMOE", **_NOCLEAN)
_pre(["laguna"], "LAGUNA", **_NOCLEAN)
_pre(["minimax-m2"], "MINIMAX_M2", **_NOCLEAN)
_pre(["solar-open"], "SOLAR_OPEN", **_NOCLEAN)
_pre(["mellum2"], "MELLUM2")

_BYTE_ENCODE_OFF = frozenset(["GEMMA4", "SARVAM_MOE", "WHITESPACE"])

_CUSTOM_SPLITTERS = {
    _RE_GPT2: _split_gpt2,
    _RE_LLAMA3: _split_llama3,
    _RE_LLAMA3_ORIG: _split_llama3,
    _RE_QWEN2: _split_qwen2,
    _RE_QWEN35: _split_qwen35,
    "\\p{Han}+": _split_kimi_k2,
    "\\p{AFMoE_digits}": _split_digit_groups,
    _RE_NEWLINE_RUNS: _split_newlines,
    _RE_TINY_AYA_DIGITS: _split_digit_groups,
}

# ---- generic path: std::regex on the collapsed text / std::wregex on code points ------------
_UCAT_ENUM = {
    "\\p{N}": F_NUMBER, "\\p{L}": F_LETTER, "\\p{P}": F_PUNCT, "\\p{M}": F_MARK, "\\p{S}": F_SYMBOL,
    "\\p{Lu}": F_LETTER, "\\p{Ll}": F_LETTER, "\\p{Lt}": F_LETTER, "\\p{Lm}": F_LETTER, "\\p{Lo}": F_LETTER,
}
_UCAT_CPT = {F_NUMBER: "\xd1", F_LETTER: "\xd2", F_PUNCT: "\xd3", F_MARK: "\xd4", F_SYMBOL: "\xd5"}
_UCAT_MAP = {
    F_NUMBER: "\x30-\x39",
    F_LETTER: "\x41-\x5A\x61-\x7A",
    F_PUNCT: "\x21-\x23\x25-\x2A\x2C-\x2F\x3A-\x3B\x3F-\x40\\\x5B-\\\x5D\x5F\\\x7B\\\x7D",
    F_MARK: "",
    F_SYMBOL: "\\\x24\\\x2B\x3C-\x3E\x5E\x60\\\x7C\\\x7E",
}


def _uses_collapse(expr: str) -> bool:
    return any(k in expr for k in _UCAT_ENUM)


def _collapse_regex(expr: str) -> str:
    """The collapsed form of a regex, exactly as unicode_regex_split builds it."""
    out = []
    inside = False
    i = 0
    n = len(expr)
    while i < n:
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and ch == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if ch == "\\" and i + 3 < n and expr[i + 1] == "p" and expr[i + 2] == "{":
            close = expr.find("}", i + 3)
            if close != -1 and close <= i + 10:
                pat = expr[i:close + 1]
                cat = _UCAT_ENUM.get(pat)
                if cat is not None:
                    if not inside:
                        out.append("[")
                    out.append(_UCAT_CPT[cat])
                    out.append(_UCAT_MAP[cat])
                    if not inside:
                        out.append("]")
                    i = close + 1
                    continue
        out.append(ch)
        i += 1
    return "".join(out)


def _ecma_to_python(expr: str) -> str:
    """ECMAScript -> Python `regex`: only `$` differs for these patterns (ECMAScript's `$` without
    multiline matches at the very end only; Python's also before a final newline)."""
    out = []
    inside = False
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "\\":
            out.append(expr[i:i + 2])
            i += 2
            continue
        if ch == "[" and not inside:
            inside = True
        elif ch == "]" and inside:
            inside = False
        elif ch == "$" and not inside:
            out.append("\\Z")
            i += 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _compile_ecma(expr: str):
    return regex.compile(_ecma_to_python(expr), regex.ASCII | regex.VERSION0)


def _split_stl(text: str, pattern, offsets: list[int]) -> list[int]:
    out = []
    start = 0
    for off in offsets:
        seg = text[start:start + off]
        idx = 0
        for m in pattern.finditer(seg):
            a, b = m.span()
            if a > idx:
                out.append(a - idx)
            if b > a:  # llama.cpp also records empty matches; they produce no tokens
                out.append(b - a)
            idx = b
        if idx < off:
            out.append(off - idx)
        start += off
    return out


def _collapse_text(text: str, flags: list[int]) -> str:
    out = []
    for c, f in zip(text, flags):
        if c < "\x80":
            out.append(c)
        elif f & F_WHITESPACE:
            out.append("\x0b")
        else:
            out.append(_UCAT_CPT.get(f & F_CATEGORIES, "\xd0"))
    return "".join(out)


def _wide_text(text: str, flags: list[int]) -> str:
    return "".join("\x0b" if (c >= "\x80" and f & F_WHITESPACE) else c for c, f in zip(text, flags))


class _PreTokenizer:
    """unicode_regex_split with a fixed list of regexes (without the byte encoding step)."""

    def __init__(self, exprs: list[str]):
        self.exprs = list(exprs)
        self.steps = []
        for e in exprs:
            custom = _CUSTOM_SPLITTERS.get(e)
            if custom is not None:
                self.steps.append(("custom", custom))
            elif _uses_collapse(e):
                if any(ord(c) >= 128 for c in e):
                    raise ValueError(f"regex includes both unicode categories and non-ASCII characters: {e!r}")
                self.steps.append(("collapsed", _compile_ecma(_collapse_regex(e))))
            else:
                self.steps.append(("wide", _compile_ecma(e)))

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        flags = _flags_list(text)
        offsets = [len(text)]
        collapsed = wide = None
        for kind, obj in self.steps:
            if kind == "custom":
                offsets = obj(text, flags, offsets)
            elif kind == "collapsed":
                if collapsed is None:
                    collapsed = _collapse_text(text, flags)
                offsets = _split_stl(collapsed, obj, offsets)
            else:
                if wide is None:
                    wide = _wide_text(text, flags)
                offsets = _split_stl(wide, obj, offsets)
        words = []
        start = 0
        for off in offsets:
            if off:
                words.append(text[start:start + off])
            start += off
        return words


_PRE_TOKENIZER_CACHE: dict[str, _PreTokenizer] = {}


def _resolve_pre(pre: str | None) -> tuple[str, dict]:
    if not pre:
        return "DEFAULT", {}
    try:
        return _PRE_TYPES[pre]
    except KeyError:
        raise ValueError(f"unknown pre-tokenizer type: {pre!r} (tokenizer.ggml.pre)") from None


def pre_tokenize_regexes(pre: str) -> list[str]:
    """The regex list llama.cpp uses for a `tokenizer.ggml.pre` name (ValueError if unknown)."""
    ptype, _ = _resolve_pre(pre)
    return list(_PRE_REGEXES.get(ptype, _PRE_REGEXES["DEFAULT"]))


def _pre_tokenizer_for(ptype: str) -> _PreTokenizer:
    pt = _PRE_TOKENIZER_CACHE.get(ptype)
    if pt is None:
        pt = _PRE_TOKENIZER_CACHE[ptype] = _PreTokenizer(_PRE_REGEXES.get(ptype, _PRE_REGEXES["DEFAULT"]))
    return pt


def split_pre_tokens(text: str, pre: str) -> list[str]:
    """Pre-tokenize `text` as llama.cpp does for `tokenizer.ggml.pre == pre` (before byte encoding)."""
    ptype, _ = _resolve_pre(pre)
    return _pre_tokenizer_for(ptype).split(text)


# --------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode table
# --------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in bs}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


_BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_UNICODE)}
_BYTE_ENCODE_TABLE = {b: c for b, c in enumerate(_BYTE_TO_UNICODE)}  # for str.translate on latin-1 text


def _byte_encode(word: str) -> str:
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


_C_ISSPACE = " \t\n\v\f\r"

# auto-detected special token texts (llama_vocab::impl::load)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                  "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                  "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                  "\u2581<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")

_CACHE_LIMIT = 65536


_GROUP_MIN = 64   # special texts sharing a first character, from which they are found by position
_FRAG_MIN = 256   # fragments at least this long are remembered whole (Tokenizer._fragment_ids)
_FRAG_CACHE_CHARS = 1 << 22   # ... up to this many characters in all (~40 conversations of 23K tokens;
                              # least recently used dropped)


class Tokenizer:
    """llama.cpp-exact tokenizer for GGUF 'gpt2' (byte-level BPE), 'gemma4' and 'llama' (SPM) vocabularies."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: frozenset[int]

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        return cls(md)

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        from engine.gguf.reader import GGUFFile
        return cls(GGUFFile(path).metadata)

    def __init__(self, md: dict):
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.model")
        pre = md.get("tokenizer.ggml.pre") or ""
        self.model = model
        self.pre = pre

        bos, eos, unk = None, None, None
        add_space_prefix = False
        add_bos = add_eos = add_sep = False
        ignore_merges = False
        clean_spaces = False
        escape_whitespaces = True
        merges = None

        if model == "llama":
            self.kind = "spm"
            bos, eos, unk = 1, 2, 0
            self.pre_type = "DEFAULT"
            add_space_prefix = True
            add_bos, add_eos = True, False
        elif model in ("gpt2", "gemma4"):
            self.kind = "bpe"
            merges = md.get("tokenizer.ggml.merges")
            if model == "gemma4":
                pre = "gemma4"
                bos = eos = None
            else:
                bos = eos = 11
            if merges is None and not (model == "gpt2" and pre == "kimi-k2"):
                raise ValueError("cannot find tokenizer merges in model metadata (tokenizer.ggml.merges)")
            ptype, opts = _resolve_pre(pre)
            self.pre_type = ptype
            add_space_prefix = False
            escape_whitespaces = False
            clean_spaces = True
            ignore_merges = opts.get("ignore_merges", False)
            clean_spaces = opts.get("clean_spaces", clean_spaces)
            escape_whitespaces = opts.get("escape_whitespaces", escape_whitespaces)
            add_bos = opts.get("add_bos", add_bos)
            add_sep = opts.get("add_sep", add_sep)
            if opts.get("bos_null"):
                bos = None
        elif model in ("bert", "t5", "rwkv", "plamo2", "no_vocab", "none", "hybriddna", "whitespace"):
            raise ValueError(f"unsupported tokenizer model: {model!r} (only 'gpt2', 'gemma4' and 'llama' are)")
        else:
            raise ValueError(f"unknown tokenizer model: {model!r}")

        v = md.get("tokenizer.ggml.add_space_prefix")
        if v is not None:
            add_space_prefix = bool(v)

        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("cannot find tokenizer vocab in model metadata (tokenizer.ggml.tokens)")
        tokens = list(tokens)
        n = len(tokens)
        for i, t in enumerate(tokens):
            if not t:
                tokens[i] = f"[EMPTY_{i}]"
        tok2id = dict(zip(tokens, range(n)))
        if len(tok2id) != n:
            # llama.cpp refuses duplicate token texts; here they can only come from the GGUF reader
            # decoding invalid UTF-8 token bytes lossily, so keep the first id instead of failing
            tok2id = dict(zip(reversed(tokens), range(n - 1, -1, -1)))
        scores = md.get("tokenizer.ggml.scores")
        if scores is not None:
            if len(scores) < n:
                raise ValueError(f"tokenizer scores shorter than the vocabulary ({len(scores)} < {n})")
            scores = [float(s) for s in scores] if not isinstance(scores[0], float) else list(scores)
        types = md.get("tokenizer.ggml.token_type")
        if types is not None:
            if len(types) < n:
                raise ValueError(f"tokenizer token types shorter than the vocabulary ({len(types)} < {n})")
            tmap = _TYPE_TO_ATTR
            attrs = [tmap.get(t, ATTR_UNDEFINED) for t in types[:n]]
        else:
            attrs = [ATTR_NORMAL] * n

        self.tokens = tokens
        self._tok2id = tok2id
        self.scores = scores
        self._attrs = attrs
        self.vocab_size = n

        # ---- special token ids
        def _valid_default(x):
            return x if (x is not None and 0 <= x < n) else None

        ids = {"bos": _valid_default(bos), "eos": _valid_default(eos), "eot": None, "eom": None,
               "unk": _valid_default(unk), "sep": None, "pad": None, "mask": None,
               "fim_pre": None, "fim_suf": None, "fim_mid": None, "fim_pad": None, "fim_rep": None,
               "fim_sep": None}
        for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"),
                          ("eom_token_id", "eom"), ("unknown_token_id", "unk"), ("seperator_token_id", "sep"),
                          ("padding_token_id", "pad"), ("mask_token_id", "mask"),
                          ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"),
                          ("fim_mid_token_id", "fim_mid"), ("fim_pad_token_id", "fim_pad"),
                          ("fim_rep_token_id", "fim_rep"), ("fim_sep_token_id", "fim_sep"),
                          ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"),
                          ("middle_token_id", "fim_mid")):
            val = md.get("tokenizer.ggml." + key)
            if val is None:
                continue
            val = int(val)
            if 0 <= val < n:
                ids[name] = val

        v = md.get("tokenizer.ggml.add_bos_token")
        if v is not None:
            add_bos = bool(v)
        v = md.get("tokenizer.ggml.add_eos_token")
        if v is not None:
            add_eos = bool(v)
        v = md.get("tokenizer.ggml.add_sep_token")
        if v is not None:
            add_sep = bool(v)
        if self.kind == "bpe" and self.pre_type == "GEMMA4" and not add_bos:
            add_bos = True  # llama.cpp's Gemma 4 workaround
        if add_bos and ids["bos"] is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if add_eos and ids["eos"] is None:
            raise ValueError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

        def _find_first(texts):
            found = [tok2id[t] for t in texts if t in tok2id]
            return min(found) if found else None

        def _force_control(i):
            attrs[i] |= ATTR_CONTROL

        # auto-detect EOT / EOM / FIM tokens by text (their type becomes CONTROL)
        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), ("fim_pre", _FIM_PRE_TEXTS),
                            ("fim_suf", _FIM_SUF_TEXTS), ("fim_mid", _FIM_MID_TEXTS), ("fim_pad", _FIM_PAD_TEXTS),
                            ("fim_rep", _FIM_REP_TEXTS), ("fim_sep", _FIM_SEP_TEXTS)):
            if ids[name] is None:
                i = _find_first(texts)
                if i is not None:
                    ids[name] = i
                    _force_control(i)

        # control tokens with "unused" in their text are unused
        for i in range(n):
            if attrs[i] & ATTR_CONTROL and not attrs[i] & ATTR_UNUSED and "unused" in tokens[i]:
                attrs[i] |= ATTR_UNUSED

        eog: set[int] = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if ids[name] is not None:
                eog.add(ids[name])
        for t in _EOG_TEXTS:
            i = tok2id.get(t)
            if i is not None:
                eog.add(i)
                _force_control(i)
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss hack
            i = tok2id.get(t)
            if i is not None:
                attrs[i] = ATTR_USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if ids[name] is not None:
                eog.add(ids[name])
        # o200k_harmony / solar-open: <|end|> is not EOG
        eog_texts = {tokens[i]: i for i in eog}
        if "<|end|>" in eog_texts and (("<|return|>" in eog_texts and ("<|call|>" in eog_texts
                                                                       or "<|calls|>" in eog_texts))
                                       or (("<|call|>" in eog_texts or "<|calls|>" in eog_texts)
                                           and "<|flush|>" in eog_texts)):
            end_id = eog_texts["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = ATTR_USER_DEFINED
        # gemma4 / paddleocr: </s> is not EOG
        if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
            s_id = eog_texts["</s>"]
            eog.discard(s_id)
            attrs[s_id] = ATTR_NORMAL

        # special tokens cache: control, user-defined and unknown tokens, longest (in bytes) first
        special = [i for i in range(n) if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8")))

        # per-token lstrip/rstrip attributes set by model/tokenizer name
        model_name = str(md.get("general.name") or "").lower()
        arch = str(md.get("general.architecture") or "")
        if (any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
                or any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3"))):
            if "<mask>" in tok2id:
                attrs[tok2id["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in model_name or "phi3" in model_name:
            for i in special:
                attrs[i] |= ATTR_RSTRIP
            if "</s>" in tok2id:
                attrs[tok2id["</s>"]] |= ATTR_RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in tok2id:
                    attrs[tok2id[t]] &= ~ATTR_RSTRIP
        elif "modern-bert" in model_name:
            if "[MASK]" in tok2id:
                attrs[tok2id["[MASK]"]] |= ATTR_LSTRIP

        self._special = [(i, tokens[i], bool(attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)),
                          bool(attrs[i] & ATTR_LSTRIP), bool(attrs[i] & ATTR_RSTRIP)) for i in special]
        # special texts grouped by first character where a group is large (Gemma: 6321 start with "<"):
        # first char -> (texts, their distinct lengths), for _present
        groups: dict[str, set] = {}
        for _, stext, *_ in self._special:
            if stext:
                groups.setdefault(stext[0], set()).add(stext)
        self._special_groups = {c: (g, sorted({len(t) for t in g})) for c, g in groups.items()
                                if len(g) >= _GROUP_MIN}

        self.bos_id = ids["bos"]
        self.eos_id = ids["eos"]
        self.eot_id = ids["eot"]
        self.eom_id = ids["eom"]
        self.unk_id = ids["unk"]
        self.sep_id = ids["sep"]
        self.pad_id = ids["pad"]
        self.mask_id = ids["mask"]
        self.fim_ids = {k: ids[k] for k in ("fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")}
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_sep = add_sep
        self.add_space_prefix = add_space_prefix
        self.clean_spaces = clean_spaces
        self.escape_whitespaces = escape_whitespaces
        self.ignore_merges = ignore_merges
        self.eog_ids = frozenset(eog)

        self._pieces: list[bytes | None] = [None] * n
        self._cache: dict[str, tuple[int, ...]] = {}
        # whole fragments between special tokens -> ids (see _fragment_ids)
        self._frag_cache: collections.OrderedDict = collections.OrderedDict()
        self._frag_chars = 0
        self._frag_lock = threading.Lock()
        if self.kind == "bpe":
            self._byte_encode = self.pre_type not in _BYTE_ENCODE_OFF
            self._pretok = _pre_tokenizer_for(self.pre_type)
            # key "left right": tokens never contain a space, so this is llama.cpp's (left, right) map;
            # the first occurrence of a duplicated merge wins, as with unordered_map::emplace
            m = list(merges or ())
            self._ranks = dict(zip(reversed(m), range(len(m) - 1, -1, -1)))
        else:
            self._byte_encode = False
            self._pretok = None
            self._ranks = {}

    # ---------------------------------------------------------------- queries
    def token_to_id(self, piece: str) -> int | None:
        return self._tok2id.get(piece)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[token_id]

    def token_attr(self, token_id: int) -> int:
        return self._attrs[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (llama_vocab_is_control)."""
        return 0 <= token_id < self.vocab_size and bool(self._attrs[token_id] & ATTR_CONTROL)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def __len__(self) -> int:
        return self.vocab_size

    # ---------------------------------------------------------------- encoding
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama_tokenize(text, add_special, parse_special)."""
        text = _sanitize(text)
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if self.kind == "spm":
            is_prev_special = True
            if add_special and self.add_bos:
                out.append(self.bos_id)
            for f in frags:
                if type(f) is str:
                    out.extend(self._fragment_ids(f, is_prev_special))
                    is_prev_special = False
                else:
                    out.append(f)
                    is_prev_special = True
            if add_special and self.add_eos:
                out.append(self.eos_id)
        else:
            if add_special and self.add_bos:
                out.append(self.bos_id)
            for f in frags:
                if type(f) is str:
                    out.extend(self._fragment_ids(f, False))
                else:
                    out.append(f)
            if add_special and self.add_eos:
                out.append(self.eos_id)
        return out

    def _fragment_ids(self, f: str, prev_special: bool) -> list[int] | tuple[int, ...]:
        """The ids of one text fragment between special tokens (a fragment's ids depend only on its text
        and, for SPM, on whether a special token came before it). Long fragments are remembered: a chat
        request re-renders the whole conversation, whose earlier messages are such fragments, so a
        follow-up tokenizes only its new ones (a 25K-token conversation: 1 ms instead of 33, SmolLM2)."""
        spm = self.kind == "spm"
        key = (f, prev_special and spm)
        keep = len(f) >= _FRAG_MIN
        if keep:
            with self._frag_lock:
                ids = self._frag_cache.get(key)
                if ids is not None:
                    self._frag_cache.move_to_end(key)
                    return ids
        if spm:
            if self.add_space_prefix and prev_special:
                f = " " + f
            ids = tuple(self._spm_fragment(f.replace(" ", "\u2581")))
        else:
            out: list[int] = []
            self._bpe_fragment(f.replace(" ", "\u2581") if self.escape_whitespaces else f, out)
            ids = tuple(out)
        if keep:
            with self._frag_lock:
                if key not in self._frag_cache:
                    self._frag_cache[key] = ids
                    self._frag_chars += len(key[0])
                while self._frag_chars > _FRAG_CACHE_CHARS and self._frag_cache:
                    (old, _), _ids = self._frag_cache.popitem(last=False)
                    self._frag_chars -= len(old)
        return ids

    def _present(self, text: str) -> set[str]:
        """The special texts of the large groups that occur in `text`: at each position of a group's
        first character, the substrings of the group's lengths looked up (Gemma's 6321 texts that start
        with "<" were otherwise 6321 scans of the whole text: 0.26 s for a 54K-token conversation)."""
        found: set[str] = set()
        for c, (texts, lengths) in self._special_groups.items():
            p = text.find(c)
            while p >= 0:
                for n in lengths:
                    sub = text[p:p + n]
                    if len(sub) < n:
                        break
                    if sub in texts:
                        found.add(sub)
                p = text.find(c, p + 1)
        return found

    def _partition(self, text: str, parse_special: bool) -> list:
        """tokenizer_st_partition: split the text on special tokens (longest first)."""
        frags: list = [text]
        present = self._present(text) if self._special_groups else None
        groups = self._special_groups
        for tid, stext, ctrl_or_unk, lstrip, rstrip in self._special:
            if ctrl_or_unk and not parse_special:
                continue
            if stext[:1] in groups:
                if stext not in present:
                    continue
            elif stext not in text:
                continue
            new: list = []
            slen = len(stext)
            for f in frags:
                if type(f) is not str or stext not in f:
                    new.append(f)
                    continue
                pos = 0
                flen = len(f)
                while True:
                    m = f.find(stext, pos)
                    if m < 0:
                        break
                    if m > pos:
                        left = f[pos:m]
                        if lstrip:
                            left = left.rstrip(_C_ISSPACE)
                        if left:
                            new.append(left)
                    new.append(tid)
                    pos = m + slen
                    if rstrip:
                        while pos < flen and f[pos] in _C_ISSPACE:
                            pos += 1
                if pos < flen:
                    new.append(f[pos:])
            frags = new
        return frags

    # ---- BPE
    def _bpe_fragment(self, text: str, out: list[int]) -> None:
        cache = self._cache
        words = self._pretok.split(text)
        if self._byte_encode:
            words = [_byte_encode(w) for w in words]
        for w in words:
            ids = cache.get(w)
            if ids is None:
                ids = self._bpe_word(w)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[w] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        vocab = self._tok2id
        if self.ignore_merges and word in vocab:
            return (vocab[word],)
        if self.pre_type == "GEMMA4" and word.strip("\n") == "" and word in vocab:
            return (vocab[word],)
        syms = list(word)
        n = len(syms)
        if n > 1:
            ranks = self._ranks
            prv = list(range(-1, n - 1))
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            heap = []
            for i in range(n - 1):
                a, b = syms[i], syms[i + 1]
                r = ranks.get(a + " " + b)
                if r is not None:
                    heap.append((r, i, i + 1, a + b))
            heapq.heapify(heap)
            pop, push = heapq.heappop, heapq.heappush
            while heap:
                _r, left, right, t = pop(heap)
                ls = syms[left]
                rs = syms[right]
                if not ls or not rs or ls + rs != t:
                    continue
                syms[left] = t
                syms[right] = ""
                nx = nxt[right]
                nxt[left] = nx
                if nx >= 0:
                    prv[nx] = left
                p = prv[left]
                if p >= 0:
                    ps = syms[p]
                    r = ranks.get(ps + " " + t)
                    if r is not None:
                        push(heap, (r, p, left, ps + t))
                if nx >= 0:
                    ns = syms[nx]
                    r = ranks.get(t + " " + ns)
                    if r is not None:
                        push(heap, (r, left, nx, t + ns))
        out = []
        for s in syms:
            if not s:
                continue
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
                continue
            # not in the vocabulary: llama.cpp looks up every byte of the (encoded) symbol
            for b in s.encode("utf-8"):
                if self._byte_encode:
                    tid = vocab.get(chr(b)) if b < 0x80 else None
                else:
                    tid = vocab.get("<0x%02X>" % b)
                if tid is not None:
                    out.append(tid)
        return tuple(out)

    # ---- SPM
    def _spm_fragment(self, text: str) -> tuple[int, ...]:
        cache = self._cache
        ids = cache.get(text)
        if ids is None:
            ids = self._spm_tokenize(text)
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            cache[text] = ids
        return ids

    def _spm_tokenize(self, text: str) -> tuple[int, ...]:
        n = len(text)
        if n == 0:
            return ()
        vocab = self._tok2id
        scores = self.scores
        if scores is None:
            scores = self.scores = [0.0] * self.vocab_size
        lens = [1] * n
        prv = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []
        for i in range(n - 1):
            tid = vocab.get(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _s, left, right, size = pop(heap)
            ll = lens[left]
            rl = lens[right]
            if ll == 0 or rl == 0 or ll + rl != size:
                continue
            ll += rl
            lens[left] = ll
            lens[right] = 0
            nx = nxt[right]
            nxt[left] = nx
            if nx >= 0:
                prv[nx] = left
            p = prv[left]
            if p >= 0:
                sz = lens[p] + ll
                tid = vocab.get(text[p:p + sz])
                if tid is not None:
                    push(heap, (-scores[tid], p, left, sz))
            if nx >= 0:
                sz = ll + lens[nx]
                tid = vocab.get(text[left:left + sz])
                if tid is not None:
                    push(heap, (-scores[tid], left, nx, sz))
        out = []
        i = 0
        while i != -1:
            sym = text[i:i + lens[i]]
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                # merged symbols are always in the vocabulary, so this is a single code point:
                # byte fallback (resegment's rev_merge lookup can never hit here)
                for b in sym.encode("utf-8"):
                    out.append(self._byte_to_token(b))
            i = nxt[i]
        return tuple(out)

    def _byte_to_token(self, b: int) -> int:
        tid = self._tok2id.get("<0x%02X>" % b)
        if tid is None and b < 0x80:
            tid = self._tok2id.get(chr(b))
        if tid is None:
            if self.unk_id is None:
                raise ValueError(f"vocabulary has no byte token for 0x{b:02X} and no unknown token")
            tid = self.unk_id
        return tid

    # ---------------------------------------------------------------- decoding
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of llama_token_to_piece(token, special=True)."""
        p = self._pieces[token_id]
        if p is None:
            p = self._pieces[token_id] = self._make_piece(token_id)
        return p

    def _make_piece(self, token_id: int) -> bytes:
        attr = self._attrs[token_id]
        text = self.tokens[token_id]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.kind == "spm" or self.escape_whitespaces:
                return text.replace("\u2581", " ").encode("utf-8")
            out = bytearray()
            for c in text:
                b = _UNICODE_TO_BYTE.get(c)
                if b is not None:
                    out.append(b)
                else:
                    u = c.encode("utf-8")
                    out += b"[UNK_BYTE_0x" + u.hex().encode() + text.encode("utf-8") + b"]"
            return bytes(out)
        if attr & ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""

    def piece(self, token_id: int, special: bool = True, lstrip: int = 0) -> bytes:
        """llama_token_to_piece(token, lstrip, special) as bytes."""
        if not special and self._attrs[token_id] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        p = self.token_bytes(token_id)
        while lstrip > 0 and p[:1] == b" ":
            p = p[1:]
            lstrip -= 1
        return p

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """llama_detokenize(remove_special=false, unparse_special=not skip_special) as bytes."""
        special = not skip_special
        remove_space = self.add_space_prefix
        parts = []
        for t in ids:
            parts.append(self.piece(int(t), special, 1 if remove_space else 0))
            remove_space = False
        data = b"".join(parts)
        if self.clean_spaces:
            data = _clean_spaces(data)
        return data

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")


def _clean_spaces(text: bytes) -> bytes:
    """The three clean-up passes at the end of llama_vocab::impl::detokenize."""
    t = bytearray(text)
    # pass 1: " ?", " !", " .", " ,"
    if t:
        out = bytearray(t[:1])
        for i in range(1, len(t)):
            x = t[i]
            if t[i - 1] == 0x20 and x in b"?!.,":
                out.pop()
            out.append(x)
        t = out
    # pass 2: strip single apostrophe between spaces " ' "
    if t:
        out = bytearray(t[:1])
        n = len(t)
        i = 1
        while i < n:
            x = t[i]
            if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
                out.pop()  # remove the previous space
                t[i + 1] = 0  # llama.cpp overwrites the next space with '\0' and skips it
                out.append(x)
                i += 2
                continue
            out.append(x)
            i += 1
        t = out
    # pass 3: apostrophe contractions " 's", " 'm", " 're", " 've"
    if t:
        out = bytearray(t[:1])
        n = len(t)
        for i in range(1, n):
            x = t[i]
            if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
                x1 = t[i + 1]
                if x1 in b"sm":
                    out.pop()
                elif x1 not in b"td" and i + 2 < n:
                    x2 = t[i + 2]
                    if (x1 == 0x72 and x2 == 0x65) or (x1 == 0x76 and x2 == 0x65):
                        out.pop()
            out.append(x)
        t = out
    return bytes(t)


def _sanitize(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class StreamDecoder:
    """Incremental detokenization that never splits a multi-byte UTF-8 character.

    Pieces are llama.cpp's token_to_piece (special tokens rendered unless `skip_special`; the first
    piece loses one leading space when the vocabulary has add_space_prefix, like Tokenizer.decode).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        tok = self.tokenizer
        lstrip = 1 if (self._first and tok.add_space_prefix) else 0
        self._first = False
        return self._decoder.decode(tok.piece(int(token_id), not self.skip_special, lstrip))

    def flush(self) -> str:
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out
