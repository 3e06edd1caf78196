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
from engine.tokenizer.pretokenize import pre_tokenize_regexes, split_pre_tokens
from engine.tokenizer.tokenizer import StreamDecoder, Tokenizer

__all__ = ["Tokenizer", "StreamDecoder", "pre_tokenize_regexes", "split_pre_tokens"]
