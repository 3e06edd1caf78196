"""engine.tokenizer: exact llama.cpp token ids on the reference texts, decoding, streaming, special
tokens, and the pre-tokenizer variants on small handcrafted vocabularies."""
from __future__ import annotations

import ast
import time

import pytest
import regex

from engine.gguf.reader import GGUFFile
from engine.tokenizer import StreamDecoder, Tokenizer, pre_tokenize_regexes, split_pre_tokens

MODELS = ["smollm2", "gemma3"]
TEXTS = ["gpl3", "heapq_py", "unicode_mix"]


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def metadata(model_paths):
    return {name: GGUFFile(path).metadata for name, path in model_paths.items()}


@pytest.fixture(scope="session")
def tokenizers(metadata):
    return {name: Tokenizer.from_metadata(md) for name, md in metadata.items()}


def _text(reference_dir, name: str) -> str:
    # llama-tokenize -f reads the file as is (final newline included)
    return (reference_dir / "texts" / f"{name}.txt").read_bytes().decode("utf-8")


def _ref_ids(reference_dir, model: str, text: str) -> list[int]:
    return list(ast.literal_eval((reference_dir / f"{model}.{text}.tokens.txt").read_text()))


# ------------------------------------------------------------------- llama.cpp reference ids
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("model", MODELS)
def test_ids_match_llama_cpp(tokenizers, reference_dir, model, text):
    tok = tokenizers[model]
    ids = tok.encode(_text(reference_dir, text))  # add_special=True, parse_special=True
    ref = _ref_ids(reference_dir, model, text)
    if ids != ref:
        i = next((k for k, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
        pytest.fail(f"{model}/{text}: first difference at {i}: ours {ids[i:i + 8]} "
                    f"{[tok.tokens[t] for t in ids[i:i + 8]]} vs llama.cpp {ref[i:i + 8]} "
                    f"{[tok.tokens[t] for t in ref[i:i + 8]]} (lengths {len(ids)} / {len(ref)})")


def test_model_settings(tokenizers):
    s, g = tokenizers["smollm2"], tokenizers["gemma3"]
    assert (s.vocab_size, s.bos_id, s.eos_id, s.add_bos, s.add_eos) == (49152, 1, 2, False, False)
    assert (g.vocab_size, g.bos_id, g.eos_id, g.add_bos, g.add_eos) == (262144, 2, 1, True, False)
    # llama.cpp's EOG sets: eos, <|im_end|>/<|endoftext|>, the FIM-repo token (<reponame>) ...
    assert s.eog_ids == frozenset({0, 2, 4})
    # ... and <eos>, <end_of_turn> and </s> (auto-detected by text) for Gemma 3
    assert g.eog_ids == frozenset({1, 106, 212})
    assert s.is_special(1) and s.is_special(2) and not s.is_special(100)
    assert g.is_special(106) and not g.is_special(107)  # <end_of_turn> control, "\n" user-defined


def test_speed(metadata, reference_dir):
    t0 = time.perf_counter()
    tok = Tokenizer.from_metadata(metadata["gemma3"])
    build = time.perf_counter() - t0
    assert build < 1.0, f"building the 262K-token tokenizer took {build:.2f} s"
    text = _text(reference_dir, "gpl3")
    for md in metadata.values():
        tok = Tokenizer.from_metadata(md)  # fresh caches
        t0 = time.perf_counter()
        tok.encode(text)
        dt = time.perf_counter() - t0
        assert dt < 2.0, f"{md['tokenizer.ggml.model']}: encoding gpl3.txt took {dt:.2f} s"


# -------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("model", MODELS)
def test_round_trip_unicode(tokenizers, reference_dir, model):
    tok = tokenizers[model]
    text = _text(reference_dir, "unicode_mix")
    ids = tok.encode(text)
    body = ids[1:] if tok.add_bos else ids
    assert tok.decode(body) == text
    # skipping special tokens drops the control tokens the text contains (e.g. <|im_end|>, <start_of_turn>)
    without_control = text
    for t in set(body):
        if tok.is_special(t):
            without_control = without_control.replace(tok.tokens[t], "")
    assert without_control != text
    assert tok.decode(ids, skip_special=True) == without_control
    if tok.add_bos:
        assert tok.decode(ids) == tok.tokens[tok.bos_id] + text
    assert b"".join(tok.token_bytes(t) for t in body) == text.encode("utf-8")


@pytest.mark.parametrize("model", MODELS)
def test_stream_decoder(tokenizers, reference_dir, model):
    tok = tokenizers[model]
    ids = tok.encode(_text(reference_dir, "unicode_mix"))
    expected = tok.decode(ids)
    sd = StreamDecoder(tok)
    chunks = []
    for t in ids:
        chunk = sd.push(t)
        assert "\ufffd" not in chunk
        chunks.append(chunk)
        assert expected.startswith("".join(chunks))
    chunks.append(sd.flush())
    assert "".join(chunks) == expected
    if model == "smollm2":  # byte-level BPE splits emoji over several tokens: some pushes hold bytes back
        assert "" in chunks[:-1]

    sd = StreamDecoder(tok, skip_special=True)
    assert "".join([sd.push(t) for t in ids]) + sd.flush() == tok.decode(ids, skip_special=True)


def test_stream_decoder_invalid_bytes(tokenizers):
    tok = tokenizers["gemma3"]
    b_e2, b_82, b_ac, b_41 = (tok.token_to_id(f"<0x{b:02X}>") for b in (0xE2, 0x82, 0xAC, 0x41))
    sd = StreamDecoder(tok)
    assert sd.push(b_e2) == "" and sd.push(b_82) == "" and sd.push(b_ac) == "\u20ac"
    assert sd.push(b_e2) == "" and sd.push(b_41) == "\ufffdA"  # a broken sequence is replaced once known
    assert sd.push(b_e2) == "" and sd.flush() == "\ufffd"
    assert tok.decode([b_e2, b_82]) == "\ufffd"


def test_token_bytes(tokenizers):
    s, g = tokenizers["smollm2"], tokenizers["gemma3"]
    assert s.token_bytes(s.token_to_id("\u0120the")) == b" the"
    assert s.token_bytes(s.token_to_id("\u010a")) == b"\n"
    assert s.token_bytes(2) == b"<|im_end|>"
    assert g.token_bytes(g.token_to_id("<0x41>")) == b"A"
    assert g.token_bytes(g.token_to_id("\u2581the")) == b" the"
    assert g.token_bytes(106) == b"<end_of_turn>"
    assert s.token_to_id("definitely-not-a-token") is None


# --------------------------------------------------------------------------- special tokens
def test_special_tokens_smollm2(tokenizers):
    tok = tokenizers["smollm2"]
    text = "<|im_start|>user\nHi!<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids
    assert ids == [1] + tok.encode("user\nHi!", parse_special=False) + [2] + tok.encode("\n")
    plain = tok.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == text
    assert tok.encode("", add_special=True) == []


def test_special_tokens_gemma3(tokenizers):
    tok = tokenizers["gemma3"]
    ids = tok.encode("<start_of_turn>user\nHello<end_of_turn>")
    assert ids[:2] == [2, 105] and ids[-1] == 106
    plain = tok.encode("<start_of_turn>user\nHello<end_of_turn>", parse_special=False)
    assert 105 not in plain and 106 not in plain
    assert 107 in plain  # user-defined tokens ("\n") are split off even without parse_special
    assert tok.decode(plain[1:]) == "<start_of_turn>user\nHello<end_of_turn>"
    assert tok.encode("", add_special=True) == [2]
    assert tok.encode("Hello", add_special=False) == tok.encode("Hello")[1:]


def test_special_tokens_found_by_position_as_by_scanning(tokenizers):
    """Gemma's 6321 special texts that start with "<" are found by position (Tokenizer._present) instead
    of one scan of the text each: the same fragments as the scan, with specials next to each other,
    inside others' text, unknown tags, whitespace-run tokens and both parse_special settings."""
    tok = tokenizers["gemma3"]
    assert "<" in tok._special_groups
    text = ("<start_of_turn>user\n<end_of_turn><start_of_turn><unused12><unused1>x<unused99999> a<b>c"
            "<table><tr><td>1</td></tr></table>\n\n\n    \t\t<start_of_image><<end_of_turn>>" * 3)
    fast = [tok._partition(text, ps) for ps in (True, False)]
    groups, tok._special_groups = tok._special_groups, {}
    try:
        slow = [tok._partition(text, ps) for ps in (True, False)]
    finally:
        tok._special_groups = groups
    assert fast == slow
    assert sum(type(f) is int for f in fast[0]) > 20


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_long_fragments_are_tokenized_once(tokenizers, name, monkeypatch):
    """A chat follow-up re-renders the whole conversation: fragments between special tokens that were
    seen before come from the fragment cache with the same ids (BPE and SPM, after a special token and
    not), only new ones are tokenized, and the cache stays within its character budget."""
    import engine.tokenizer.tokenizer as T
    tok = tokenizers[name]
    start, end = ("<|im_start|>", "<|im_end|>") if name == "smollm2" else ("<start_of_turn>", "<end_of_turn>")
    body = "def f(x):\n    return x * 2  # " + "the quick brown fox jumps over it. " * 30
    conv = f"{start}user\n{body}{end}\n{start}model\nok{end}\n"
    first = tok.encode(conv)
    calls = []
    inner = "_spm_fragment" if tok.kind == "spm" else "_bpe_fragment"
    real = getattr(tok, inner)
    monkeypatch.setattr(tok, inner, lambda *a: calls.append(a[0]) or real(*a))
    follow = conv + f"{start}user\nand now? {body[:40]}{end}\n"
    ids = tok.encode(follow)
    assert ids[:len(first)] == first and len(ids) > len(first)
    assert all(len(c) < T._FRAG_MIN for c in calls)          # the long message came from the cache
    monkeypatch.setattr(tok, inner, real)
    tok._frag_cache.clear()
    tok._frag_chars = 0
    assert tok.encode(follow) == ids                          # the same ids when tokenized afresh
    monkeypatch.setattr(T, "_FRAG_CACHE_CHARS", 3 * len(body))
    for i in range(10):
        tok.encode(f"{start}user\n{i}{body}{end}")
    assert tok._frag_chars <= 3 * len(body) and len(tok._frag_cache) <= 3


# ----------------------------------------------------------------------- pre-tokenizer splits
SPLIT_TEXT = "I'm 12345 don't   stop\n\n  now's WE'LL 3.14\tok"
HF_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}
EXPECTED_SPLITS = {
    "llama-bpe": ["I", "'m", " ", "123", "45", " don", "'t", "  ", " stop", "\n\n", " ", " now", "'s", " WE",
                  "'LL", " ", "3", ".", "14", "\tok"],
    "qwen2": ["I", "'m", " ", "1", "2", "3", "4", "5", " don", "'t", "  ", " stop", "\n\n", " ", " now", "'s",
              " WE", "'LL", " ", "3", ".", "1", "4", "\tok"],
    "gpt-2": ["I", "'m", " 12345", " don", "'t", "  ", " stop", "\n\n ", " now", "'s", " WE", "'", "LL", " 3",
              ".", "14", "\t", "ok"],
    # smollm: digits isolated first, then gpt-2
    "smollm": ["I", "'m", " ", "1", "2", "3", "4", "5", " don", "'t", "  ", " stop", "\n\n ", " now", "'s",
               " WE", "'", "LL", " ", "3", ".", "1", "4", "\t", "ok"],
}


@pytest.mark.parametrize("pre", sorted(EXPECTED_SPLITS))
def test_pre_tokenizer_known_splits(pre):
    assert split_pre_tokens(SPLIT_TEXT, pre) == EXPECTED_SPLITS[pre]


@pytest.mark.parametrize("pre", sorted(HF_REGEX))
def test_pre_tokenizer_matches_hf_regex(pre):
    """llama.cpp's hand-written scanners implement the tokenizer.json regexes; compare with `regex`."""
    pat = regex.compile(HF_REGEX[pre])
    texts = [SPLIT_TEXT, "Korean: 단일 RTX 3090에서\r\n\r\n  x", "naïve ca\u0301fe\u0301 \u00a0\u3000 e\u0301\u0301 'S",
             "  \t\n a,,b  !?  \n", "x²½٣ 🚀👍🏽 'rE'Ve'LL'd 's"]
    for t in texts:
        assert split_pre_tokens(t, pre) == pat.findall(t), t


def test_pre_tokenizer_variants_cover_the_text():
    text = "Hello, world! It's 1234567 dollars\n\n  don't\tcafé 日本語 한국어 🚀 x+=y<<2; <sentinel:12>\r\n"
    for pre in ["default", "gpt-2", "llama3", "llama-bpe", "qwen2", "qwen35", "smollm", "deepseek-llm",
                "deepseek-coder", "deepseek-v3", "falcon", "starcoder", "refact", "command-r", "olmo", "dbrx",
                "smaug-bpe", "poro-chat", "chatglm-bpe", "glm4", "viking", "jais", "tekken", "gpt-4o",
                "kimi-k2", "stablelm2", "mpt", "chameleon", "tiny_aya", "afmoe", "superbpe", "exaone-moe",
                "bailingmoe", "seed-coder", "minicpm5", "youtu", "granite-embed-multi-97m", "laguna", "jais-2"]:
        words = split_pre_tokens(text, pre)
        assert "".join(words) == text, pre
        assert all(words), pre
    assert split_pre_tokens("1234567 ab", "deepseek-v3")[:3] == ["123", "456", "7"]
    assert split_pre_tokens("1234567", "afmoe") == ["1", "234", "567"]
    assert split_pre_tokens("中文abc", "kimi-k2") == ["中文", "abc"]
    assert split_pre_tokens("It's", "gpt-4o") == ["It's"]
    assert split_pre_tokens("ab\u0301c d", "qwen35") == ["ab\u0301c", " d"]
    assert split_pre_tokens("ab\u0301c d", "qwen2") == ["ab", "\u0301c", " d"]  # mark as letter prefix
    assert len(pre_tokenize_regexes("default")) == 4


def test_unknown_pre_tokenizer():
    with pytest.raises(ValueError, match="no-such-pre"):
        split_pre_tokens("x", "no-such-pre")
    md = _bpe_metadata("no-such-pre")
    with pytest.raises(ValueError, match="no-such-pre"):
        Tokenizer.from_metadata(md)
    with pytest.raises(ValueError, match="bert"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# --------------------------------------------------------------- handcrafted vocabularies
def _byte_chars() -> list[str]:
    from engine.tokenizer.vocab import BYTE_TO_UNICODE as _BYTE_TO_UNICODE
    return list(_BYTE_TO_UNICODE)


def _bpe_metadata(pre: str, extra_tokens=(), merges=(), **kv) -> dict:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokens = specials + _byte_chars() + list(extra_tokens)
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    md.update(kv)
    return md


MERGES = ["\u0120 t", "h e", "\u0120t he", "a t", "\u0120 c", "\u0120c at", "1 2", "12 3", "a a"]
EXTRA = ["\u0120t", "he", "\u0120the", "at", "\u0120c", "\u0120cat", "12", "123", "aa", "\u0120dog"]


def _ids(tok, *pieces):
    return [tok.token_to_id(p) for p in pieces]


def test_handcrafted_bpe_llama3():
    tok = Tokenizer.from_metadata(_bpe_metadata("llama-bpe", EXTRA, MERGES))
    assert tok.add_bos and tok.bos_id == 0  # llama3 pre: BOS by default
    assert tok.eog_ids == frozenset({1, 2})  # eos and <|eot_id|>
    G = "\u0120"
    ids = tok.encode(" the cat<|eot_id|> 12345 aaa dog")
    assert ids == [0] + _ids(tok, G + "the", G + "cat") + [2] + _ids(tok, G, "123", "4", "5", G, "aa", "a") \
        + _ids(tok, G + "dog")  # " dog" is in the vocabulary: llama3 ignores merges for whole words
    assert tok.decode(ids[1:]) == " the cat<|eot_id|> 12345 aaa dog"
    plain = tok.encode("<|eot_id|>", add_special=False, parse_special=False)
    assert 2 not in plain and tok.decode(plain) == "<|eot_id|>"
    # metadata overrides the pre-type default
    tok2 = Tokenizer.from_metadata(_bpe_metadata("llama-bpe", EXTRA, MERGES, **{"tokenizer.ggml.add_bos_token": False}))
    assert not tok2.add_bos and tok2.encode(" the")[0] != 0


def test_handcrafted_bpe_qwen2_and_gpt2():
    G = "\u0120"
    q = Tokenizer.from_metadata(_bpe_metadata("qwen2", EXTRA, MERGES))
    assert not q.add_bos
    assert q.encode(" the 123 aaa") == _ids(q, G + "the", G, "1", "2", "3", G, "aa", "a")  # qwen2: one digit each
    g = Tokenizer.from_metadata(_bpe_metadata("gpt-2", EXTRA, MERGES))
    # gpt-2 has no ignore_merges: " dog" is in the vocabulary but no merge leads to it
    assert g.encode(" the 123 dog") == _ids(g, G + "the", G, "123", G, "d", "o", "g")
    # clean_spaces is on for gpt-2 (llama.cpp's detokenizer post-processing), off for qwen2
    ids = g.encode("a , b")
    assert g.decode(ids) == "a, b" and q.decode(q.encode("a , b")) == "a , b"


def _spm_metadata(add_space_prefix=True) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for piece, score in [("\u2581", -1.0), ("h", -2.0), ("e", -2.0), ("l", -2.0), ("o", -2.0), ("\u2581h", -3.0),
                         ("el", -4.0), ("ll", -1.5), ("llo", -2.5), ("\u2581he", -3.5), ("\u2581hello", -5.0),
                         ("<start>", 0.0)]:
        tokens.append(piece)
        types.append(4 if piece == "<start>" else 1)
        scores.append(score)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": add_space_prefix}


def test_handcrafted_spm():
    tok = Tokenizer.from_metadata(_spm_metadata())
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)
    hello = tok.token_to_id("\u2581hello")
    assert tok.encode("hello") == [1, hello]
    # byte fallback for characters outside the vocabulary, and a space after the user-defined token
    ids = tok.encode("hello é<start>hello")
    assert ids == [1, hello, tok.token_to_id("\u2581"), tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>"),
                   tok.token_to_id("<start>"), hello]
    assert tok.decode(ids, skip_special=True) == " hello é<start> hello"
    assert tok.decode(ids[1:]) == "hello é<start> hello"  # first piece loses its prefix space
    # bigrams merge best score first: "ll" (-1.5), then "▁h" (-3), then "▁he" (-3.5); "el" went stale
    assert tok.encode("hell", add_special=False) == _ids(tok, "\u2581he", "ll")
    tok2 = Tokenizer.from_metadata(_spm_metadata(add_space_prefix=False))
    assert tok2.encode("hello", add_special=False) == _ids(tok2, "h", "e", "llo")
