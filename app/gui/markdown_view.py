"""Markdown -> HTML for chat messages: `markdown` (fenced code, tables) + Pygments highlighting with
inline styles (QTextBrowser ignores CSS classes it does not know), and a "Copy" link above each code
block. Clicking it calls back with the block's source text (the view puts it on the clipboard)."""
from __future__ import annotations

import html
import re

import markdown
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound

_FENCE = re.compile(r"^(?P<indent>[ \t]{0,3})(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+#.-]*)[^\n]*\n(?P<code>.*?)"
                    r"(?:^(?P=indent)(?P=fence)[ \t]*$|\Z)", re.S | re.M)


def _lexer(lang: str, code: str):
    if lang:
        try:
            return get_lexer_by_name(lang)
        except ClassNotFound:
            pass
    try:
        lx = guess_lexer(code) if len(code) > 40 else TextLexer()
        return lx
    except ClassNotFound:
        return TextLexer()


def render(text: str, dark: bool = False) -> tuple[str, list[str]]:
    """Return (html, code blocks). Code block i gets a link `copy:i`. An unfinished fence (while a
    reply streams) is rendered as code up to the end of the text."""
    blocks: list[str] = []
    style = "monokai" if dark else "friendly"
    fmt = HtmlFormatter(noclasses=True, style=style, nowrap=True)
    bg = "#1e1f22" if dark else "#f4f5f7"
    border = "#3a3b40" if dark else "#dcdfe4"
    head = "#2b2d31" if dark else "#e8eaee"
    muted = "#9aa0a6" if dark else "#5f6368"
    placeholders: dict[str, str] = {}

    def sub(m):
        code = m.group("code")
        if code.endswith("\n"):
            code = code[:-1]
        lang = m.group("lang") or ""
        i = len(blocks)
        blocks.append(code)
        body = highlight(code, _lexer(lang, code), fmt) if code else ""
        key = f"\x00CODEBLOCK{i}\x00"
        placeholders[key] = (
            f'<table width="100%" cellspacing="0" cellpadding="6" style="margin-top:6px;margin-bottom:6px;'
            f'border:1px solid {border};background:{bg};">'
            f'<tr><td style="background:{head};color:{muted};font-size:small;">{html.escape(lang or "code")}'
            f'&nbsp;&nbsp;&nbsp;<a href="copy:{i}" style="color:{muted};">Copy</a></td></tr>'
            f'<tr><td><pre style="margin:0;font-family:monospace;white-space:pre-wrap;">{body}</pre></td></tr></table>')
        return f"\n\n{key}\n\n"

    src = _FENCE.sub(sub, text or "")
    out = markdown.markdown(src, extensions=["tables", "sane_lists", "nl2br"], output_format="html")
    for key, block in placeholders.items():
        out = out.replace(f"<p>{key}</p>", block).replace(key, block)
    return out, blocks
