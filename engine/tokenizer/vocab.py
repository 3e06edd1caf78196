"""The vocabulary's token types and llama.cpp's token attributes, the GPT-2 byte <-> unicode table, and the
texts by which llama.cpp recognises end-of-turn, fill-in-the-middle and end-of-generation tokens."""
from __future__ import annotations

from dataclasses import dataclass

from engine.tokenizer.pretokenize import resolve_pre



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

TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
    TOKEN_TYPE_UNDEFINED: ATTR_UNDEFINED,
}



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


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
BYTE_ENCODE_TABLE = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}  # for str.translate on latin-1 text


def byte_encode(word: str) -> str:
    return word.encode("utf-8").decode("latin-1").translate(BYTE_ENCODE_TABLE)


C_ISSPACE = " \t\n\v\f\r"

# auto-detected special token texts (llama_vocab::impl::load)
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                  "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")
FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                  "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")
FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                  "\u2581<MID>", "<|code_middle|>", "<|middle|>")
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")


# --------------------------------------------------------------------------------------------
# reading a GGUF vocabulary as llama.cpp's llama_vocab::load does
# --------------------------------------------------------------------------------------------
@dataclass
class VocabSettings:
    """What the vocabulary type and its pre-tokenizer name decide (llama_vocab::load's first half)."""
    kind: str                    # "spm" or "bpe"
    pre_type: str                # llama.cpp's pre-tokenizer type (pretokenize.PRE_TYPES)
    bos: int | None
    eos: int | None
    unk: int | None
    add_space_prefix: bool
    add_bos: bool
    add_eos: bool
    add_sep: bool
    ignore_merges: bool
    clean_spaces: bool
    escape_whitespaces: bool
    merges: list | None


def vocab_settings(model: str, pre: str, md: dict) -> VocabSettings:
    """The settings of a `tokenizer.ggml.model` vocabulary with pre-tokenizer `pre`; ValueError for the types
    llama.cpp has that this port does not (bert, t5, rwkv, plamo2, ...)."""
    bos, eos, unk = None, None, None
    add_space_prefix = False
    add_bos = add_eos = add_sep = False
    ignore_merges = False
    clean_spaces = False
    escape_whitespaces = True
    merges = None

    if model == "llama":
        kind = "spm"
        bos, eos, unk = 1, 2, 0
        pre_type = "DEFAULT"
        add_space_prefix = True
        add_bos, add_eos = True, False
    elif model in ("gpt2", "gemma4"):
        kind = "bpe"
        merges = md.get("tokenizer.ggml.merges")
        if model == "gemma4":
            pre = "gemma4"
            bos = eos = None
        else:
            bos = eos = 11
        if merges is None and not (model == "gpt2" and pre == "kimi-k2"):
            raise ValueError("cannot find tokenizer merges in model metadata (tokenizer.ggml.merges)")
        ptype, opts = resolve_pre(pre)
        pre_type = ptype
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

    return VocabSettings(kind, pre_type, bos, eos, unk, add_space_prefix, add_bos, add_eos, add_sep, ignore_merges,
                         clean_spaces, escape_whitespaces, merges)


def read_tokens(md: dict) -> tuple[list[str], dict[str, int], list[float] | None, list[int]]:
    """(token texts, text -> id, scores or None, llama.cpp attributes per token) from the GGUF metadata."""
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
        tmap = TYPE_TO_ATTR
        attrs = [tmap.get(t, ATTR_UNDEFINED) for t in types[:n]]
    else:
        attrs = [ATTR_NORMAL] * n

    return tokens, tok2id, scores, attrs


def special_ids(md: dict, n: int, vs: VocabSettings) -> dict[str, int | None]:
    """The special tokens' ids (bos, eos, eot, eom, unk, sep, pad, mask, fim_*): the type's defaults, then the
    metadata's; also settles vs.add_bos / add_eos / add_sep from the metadata (ValueError when one is asked for
    without its token)."""
    bos, eos, unk = vs.bos, vs.eos, vs.unk
    add_bos, add_eos, add_sep = vs.add_bos, vs.add_eos, vs.add_sep
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
    if vs.kind == "bpe" and vs.pre_type == "GEMMA4" and not add_bos:
        add_bos = True  # llama.cpp's Gemma 4 workaround
    if add_bos and ids["bos"] is None:
        raise ValueError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
    if add_eos and ids["eos"] is None:
        raise ValueError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

    vs.add_bos, vs.add_eos, vs.add_sep = add_bos, add_eos, add_sep
    return ids


def end_of_generation(ids: dict[str, int | None], tokens: list[str], tok2id: dict[str, int],
                      attrs: list[int]) -> set[int]:
    """The end-of-generation token ids; EOT / EOM / FIM tokens found by their text go into `ids`, and the
    attributes of the tokens llama.cpp special-cases are set in `attrs` (both in place)."""
    n = len(tokens)
    def _find_first(texts):
        found = [tok2id[t] for t in texts if t in tok2id]
        return min(found) if found else None

    def _force_control(i):
        attrs[i] |= ATTR_CONTROL

    # auto-detect EOT / EOM / FIM tokens by text (their type becomes CONTROL)
    for name, texts in (("eot", EOT_TEXTS), ("eom", EOM_TEXTS), ("fim_pre", FIM_PRE_TEXTS),
                        ("fim_suf", FIM_SUF_TEXTS), ("fim_mid", FIM_MID_TEXTS), ("fim_pad", FIM_PAD_TEXTS),
                        ("fim_rep", FIM_REP_TEXTS), ("fim_sep", FIM_SEP_TEXTS)):
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
    for t in EOG_TEXTS:
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

    return eog


def special_tokens(tokens: list[str], tok2id: dict[str, int], attrs: list[int], pre: str, md: dict) -> list[int]:
    """The special tokens (control, user-defined, unknown), longest in bytes first, with the per-model lstrip /
    rstrip attributes set in `attrs`."""
    n = len(tokens)
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

    return special
