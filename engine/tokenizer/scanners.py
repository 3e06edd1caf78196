"""Code point flags (llama.cpp's unicode_cpt_flags) and ports of llama.cpp's hand-written pre-tokenizer
scanners (unicode_regex_split_custom_*), line by line."""
from __future__ import annotations


import regex

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


def flags_of(ch: str) -> int:
    f = _FLAGS_CACHE.get(ch)
    if f is None:
        m = _CATEGORY_RE.match(ch)
        f = _GROUP_FLAG[m.lastindex] if m else F_UNDEFINED
        if ord(ch) in _WHITESPACE:
            f |= F_WHITESPACE
        _FLAGS_CACHE[ch] = f
    return f


def flags_list(text: str) -> list[int]:
    get = _FLAGS_CACHE.get
    out = [get(c) for c in text]
    if None in out:
        out = [flags_of(c) for c in text]
    return out


for _c in range(128):  # warm the cache with ASCII
    flags_of(chr(_c))

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


def _whitespace_end(s, fl, pos: int, L: int) -> int:
    """Where the whitespace alternatives at pos end: \\s*[\\r\\n]+, else \\s+(?!\\S), else \\s+, else one
    character (the regexes' last resort)."""
    n = 0
    last_rn = 0
    while fl[pos + n] & F_WHITESPACE:
        if s[pos + n] in _RN:
            last_rn = pos + n + 1
        n += 1
    if last_rn > 0:  # \s*[\r\n]+
        return last_rn
    if n > 1 and pos + n < L:  # \s+(?!\S)
        return pos + n - 1
    if n > 0:  # \s+
        return pos + n
    return pos + 1


def _digit_groups(fl, pos: int, n_max: int, out: list[int]) -> int:
    """\\p{N}{1,n_max} repeatedly from pos: each group's length appended to out; returns the end."""
    ini = pos
    while fl[pos] & F_NUMBER:
        pos += 1
        if pos - ini >= n_max:
            out.append(pos - ini)
            ini = pos
    if pos > ini:
        out.append(pos - ini)
    return pos


# ---- custom splitters (ports of unicode_regex_split_custom_*) --------------------------------

def split_gpt2(text, flags, offsets):
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
                pos = _digit_groups(fl, pos, digits_max, out)
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
            pos = _whitespace_end(s, fl, pos, L)
            if pos > start:
                out.append(pos - start)
    return out


def split_llama3(text, flags, offsets):
    return _split_llama3_like(text, flags, offsets, 3, False)


def split_qwen2(text, flags, offsets):
    return _split_llama3_like(text, flags, offsets, 1, False)


def split_qwen35(text, flags, offsets):
    return _split_llama3_like(text, flags, offsets, 1, True)


def _kimi_word_end(s, fl, pos: int, L: int) -> int:
    """kimi_k2's word alternatives at pos: [^\\r\\n\\p{L}\\p{N}]?[\\p{L}--\\p{Han}]+ with an optional (?i)
    contraction; the end, or -1 when they do not match here."""
    c = s[pos]
    f = fl[pos]
    is_letter_pattern = (f & F_LETTER and not _is_han(c)) or (
        not (c == "\r" or c == "\n" or f & (F_LETTER | F_NUMBER))
        and fl[pos + 1] & F_LETTER and not _is_han(s[pos + 1]))
    if not is_letter_pattern:
        return -1
    has_leading = False
    if not (c == "\r" or c == "\n" or f & (F_LETTER | F_NUMBER)):
        has_leading = True
        pos += 1
    has_letters = False
    while fl[pos] & F_LETTER and not _is_han(s[pos]):
        has_letters = True
        pos += 1
    if not (has_letters or (not has_leading and fl[pos] & F_LETTER and not _is_han(s[pos]))):
        return -1
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
    return pos


def split_kimi_k2(text, flags, offsets):
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
            end = _kimi_word_end(s, fl, pos, L)
            if end >= 0:
                out.append(end - start)
                pos = end
                continue
            # \p{N}{1,3}
            if f & F_NUMBER:
                pos = _digit_groups(fl, pos, 3, out)
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
            pos = _whitespace_end(s, fl, pos, L)
            if pos > start:
                out.append(pos - start)
    return out


def split_digit_groups(text, flags, offsets):
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


def split_newlines(text, flags, offsets):
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
