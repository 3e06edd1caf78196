"""The Tokenizer (encode: special-token partition, BPE merges or SPM bigrams; decode: token pieces, clean_spaces)
and the StreamDecoder that emits a generation's text piece by piece."""
from __future__ import annotations

import codecs
import collections
import heapq
import threading
from typing import Iterable


from engine.tokenizer.pretokenize import BYTE_ENCODE_OFF, pre_tokenizer_for
from engine.tokenizer.vocab import (end_of_generation, read_tokens, special_ids, special_tokens, vocab_settings,
                                    ATTR_BYTE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_RSTRIP, ATTR_UNKNOWN, ATTR_USER_DEFINED, C_ISSPACE, UNICODE_TO_BYTE, byte_encode)


_CACHE_LIMIT = 65536   # BPE words / SPM fragments remembered (Tokenizer._remember)
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
        v = vocab_settings(model, pre, md)
        self.kind, self.pre_type = v.kind, v.pre_type
        tokens, tok2id, scores, attrs = read_tokens(md)
        n = len(tokens)
        self.tokens = tokens
        self._tok2id = tok2id
        self.scores = scores
        self._attrs = attrs
        self.vocab_size = n
        ids = special_ids(md, n, v)
        eog = end_of_generation(ids, tokens, tok2id, attrs)
        special = special_tokens(tokens, tok2id, attrs, pre, md)
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
        self.add_bos = v.add_bos
        self.add_eos = v.add_eos
        self.add_sep = v.add_sep
        self.add_space_prefix = v.add_space_prefix
        self.clean_spaces = v.clean_spaces
        self.escape_whitespaces = v.escape_whitespaces
        self.ignore_merges = v.ignore_merges
        self.eog_ids = frozenset(eog)

        self._pieces: list[bytes | None] = [None] * n
        self._cache: dict[str, tuple[int, ...]] = {}
        # whole fragments between special tokens -> ids (see _fragment_ids)
        self._frag_cache: collections.OrderedDict = collections.OrderedDict()
        self._frag_chars = 0
        self._frag_lock = threading.Lock()
        if self.kind == "bpe":
            self._byte_encode = self.pre_type not in BYTE_ENCODE_OFF
            self._pretok = pre_tokenizer_for(self.pre_type)
            # key "left right": tokens never contain a space, so this is llama.cpp's (left, right) map;
            # the first occurrence of a duplicated merge wins, as with unordered_map::emplace
            m = list(v.merges or ())
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
                            left = left.rstrip(C_ISSPACE)
                        if left:
                            new.append(left)
                    new.append(tid)
                    pos = m + slen
                    if rstrip:
                        while pos < flen and f[pos] in C_ISSPACE:
                            pos += 1
                if pos < flen:
                    new.append(f[pos:])
            frags = new
        return frags

    def _remember(self, text: str, tokenize) -> tuple[int, ...]:
        """tokenize(text), kept in the cache of BPE words / SPM fragments (a cache miss of either path;
        the callers look the cache up themselves, the hit being the hot path). The cache is emptied
        whole when it reaches _CACHE_LIMIT entries."""
        ids = tokenize(text)
        cache = self._cache
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[text] = ids
        return ids

    # ---- BPE
    def _bpe_fragment(self, text: str, out: list[int]) -> None:
        cache = self._cache
        words = self._pretok.split(text)
        if self._byte_encode:
            words = [byte_encode(w) for w in words]
        for w in words:
            ids = cache.get(w)
            if ids is None:
                ids = self._remember(w, self._bpe_word)
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
        ids = self._cache.get(text)
        if ids is None:
            ids = self._remember(text, self._spm_tokenize)
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
                b = UNICODE_TO_BYTE.get(c)
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
