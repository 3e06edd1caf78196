"""Pre-tokenization as llama.cpp does it: the regex list each `tokenizer.ggml.pre` gets (transcribed from
llm_tokenizer_bpe's constructor), run by the hand-written scanners where llama.cpp has one and otherwise by an
emulation of std::regex on the "collapsed" text (see the package docstring)."""
from __future__ import annotations


import regex

from engine.tokenizer.scanners import (F_CATEGORIES, F_LETTER, F_MARK, F_NUMBER, F_PUNCT, F_SYMBOL, F_WHITESPACE,
                                        flags_list, split_digit_groups, split_gpt2, split_kimi_k2, split_llama3,
                                        split_newlines, split_qwen2, split_qwen35)

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

BYTE_ENCODE_OFF = frozenset(["GEMMA4", "SARVAM_MOE", "WHITESPACE"])

_CUSTOM_SPLITTERS = {
    _RE_GPT2: split_gpt2,
    _RE_LLAMA3: split_llama3,
    _RE_LLAMA3_ORIG: split_llama3,
    _RE_QWEN2: split_qwen2,
    _RE_QWEN35: split_qwen35,
    "\\p{Han}+": split_kimi_k2,
    "\\p{AFMoE_digits}": split_digit_groups,
    _RE_NEWLINE_RUNS: split_newlines,
    _RE_TINY_AYA_DIGITS: split_digit_groups,
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
        flags = flags_list(text)
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


def resolve_pre(pre: str | None) -> tuple[str, dict]:
    if not pre:
        return "DEFAULT", {}
    try:
        return _PRE_TYPES[pre]
    except KeyError:
        raise ValueError(f"unknown pre-tokenizer type: {pre!r} (tokenizer.ggml.pre)") from None


def pre_tokenize_regexes(pre: str) -> list[str]:
    """The regex list llama.cpp uses for a `tokenizer.ggml.pre` name (ValueError if unknown)."""
    ptype, _ = resolve_pre(pre)
    return list(_PRE_REGEXES.get(ptype, _PRE_REGEXES["DEFAULT"]))


def pre_tokenizer_for(ptype: str) -> _PreTokenizer:
    pt = _PRE_TOKENIZER_CACHE.get(ptype)
    if pt is None:
        pt = _PRE_TOKENIZER_CACHE[ptype] = _PreTokenizer(_PRE_REGEXES.get(ptype, _PRE_REGEXES["DEFAULT"]))
    return pt


def split_pre_tokens(text: str, pre: str) -> list[str]:
    """Pre-tokenize `text` as llama.cpp does for `tokenizer.ggml.pre == pre` (before byte encoding)."""
    ptype, _ = resolve_pre(pre)
    return pre_tokenizer_for(ptype).split(text)
