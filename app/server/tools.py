"""Tool calls and reasoning in the model's own output format.

A model writes tool calls in the format its chat template taught it. The format is chosen from the template
source:
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, Hermes, and the default
  for templates that know nothing of tools: then the tool list is written into the system prompt)
- "llama3": a bare JSON object `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`)
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`

`OutputParser` turns streamed text into ("reasoning" | "content", text) pieces and ("tool_call", {...})
items, holding back only text that might be the start of a marker. `forced_call_grammar` builds the Lark
grammar that makes a model emit exactly one call (tool_choice "required" or a named function).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

__all__ = ["ToolFormat", "detect_format", "OutputParser", "forced_call_grammar", "prepare_messages",
           "new_call_id", "tool_system_prompt"]


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolFormat:
    name: str                  # hermes | llama3 | mistral
    start: str                 # marker that opens a call ("" for llama3's bare JSON)
    end: str                   # marker that closes one ("" = until the end of the output)
    args_key: str              # "arguments" or "parameters"
    native: bool               # the template renders tools itself


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", True)
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", "", "parameters", True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", True)


def detect_format(template_source: str | None) -> ToolFormat:
    src = template_source or ""
    if "<tool_call>" in src:
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<|python_tag|>" in src or ("ipython" in src and "parameters" in src):
        return LLAMA3
    if "tools" in src and "tool_calls" in src:
        return HERMES  # a template that renders tools, in an unknown format: Hermes is the common one
    return ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", False)


def template_has_reasoning(template_source: str | None) -> bool:
    return "<think>" in (template_source or "") or "</think>" in (template_source or "")


def tool_system_prompt(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render_call(fmt: ToolFormat, name: str, arguments: str | dict) -> str:
    args = arguments if isinstance(arguments, dict) else _loads_or_str(arguments)
    obj = {"name": name, fmt.args_key: args}
    return f"<tool_call>\n{json.dumps(obj, ensure_ascii=False)}\n</tool_call>"


def _loads_or_str(s):
    try:
        return json.loads(s)
    except (TypeError, ValueError):
        return s


def _text_of(content) -> str:
    """Flatten content parts to text (small templates cannot take lists)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def prepare_messages(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat,
                     template_source: str | None) -> tuple[list[dict], list[dict] | None]:
    """Messages and tools as the template gets them. Content is flattened to a string; for templates that do
    not know tools, the tool list goes into the system prompt, earlier calls into the assistant's text and tool
    results into user turns wrapped in <tool_response>."""
    src = template_source or ""
    knows_tools = fmt.native and "tool" in src
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        role = m.get("role")
        if role == "developer":
            m["role"] = role = "system"
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("image_url", "image")
                                             for p in content):
            m["content"] = list(content)   # images stay parts: the engine's vision prompt places them
        else:
            m["content"] = _text_of(content)
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            if knows_tools:
                fixed = []
                for c in calls:
                    fn = dict(c.get("function") or {})
                    fn["arguments"] = _loads_or_str(fn.get("arguments", "{}"))
                    fixed.append({**c, "function": fn})
                m["tool_calls"] = fixed
            else:
                text = "\n".join(render_call(fmt, c["function"]["name"], c["function"].get("arguments", "{}"))
                                 for c in calls)
                prev = _text_of(m["content"])
                m["content"] = (prev + "\n" if prev else "") + text
                m.pop("tool_calls", None)
        elif role == "tool" and not knows_tools:
            m = {"role": "user", "content": f"<tool_response>\n{_text_of(m['content'])}\n</tool_response>"}
        if "reasoning_content" not in src:
            m.pop("reasoning_content", None)
        out.append({k: v for k, v in m.items() if v is not None or k == "content"})
    if tools and not knows_tools:
        sp = tool_system_prompt(tools)
        if out and out[0]["role"] == "system":
            prev = _text_of(out[0]["content"])
            out[0] = {**out[0], "content": (prev + "\n\n" + sp) if prev else sp}
        else:
            out.insert(0, {"role": "system", "content": sp})
        return out, None
    return out, tools


def _reroot(node, prefix: str):
    """A copy of a schema with every local reference ("#", "#/...") rewritten to live under `prefix` (a JSON
    pointer into the schema that embeds it), so "$defs"/"definitions" and "#" self-references keep resolving."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                out[k] = prefix + v[1:]
            else:
                out[k] = _reroot(v, prefix)
        return out
    if isinstance(node, list):
        return [_reroot(v, prefix) for v in node]
    return node


def _call_schema(fmt: ToolFormat, tool: dict, defs: dict) -> dict:
    """The schema of one call of `tool`. Its parameters schema is stored whole in `defs` (the wrapper's
    "$defs") and referenced from there, with its own references re-rooted, so that a tool whose schema uses
    "$defs"/"$ref" (pydantic models with nested models, openai.pydantic_function_tool, MCP tools) resolves
    inside the larger schema."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {"type": "object"}
    args: dict = params
    if isinstance(params, dict) and "$ref" in json.dumps(params):
        key = f"hivejet_tool_{len(defs)}"
        defs[key] = _reroot(params, f"#/$defs/{key}")
        args = {"$ref": f"#/$defs/{key}"}
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, fmt.args_key: args},
            "required": ["name", fmt.args_key], "additionalProperties": False}


def forced_call_grammar(fmt: ToolFormat, tools: list[dict], only: str | None = None) -> str:
    """Lark (llguidance) grammar for exactly one call of `only` (or of any of `tools`) in `fmt`."""
    chosen = [t for t in tools if only is None or t.get("function", t).get("name") == only]
    defs: dict = {}
    schemas = [_call_schema(fmt, t, defs) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if defs:
        schema = {**schema, "$defs": defs}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                       "key_separator": ": "}}
    body = "%json " + json.dumps(schema, ensure_ascii=False)
    if fmt.name == "hermes":
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {body}\n'
    if fmt.name == "mistral":
        return f'start: "[TOOL_CALLS][" call "]"\ncall: {body}\n'
    return f"start: call\ncall: {body}\n"


# ----------------------------------------------------------------------------------------------- parsing
def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


def _parse_call_obj(obj, fmt: ToolFormat) -> dict | None:
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "function" and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        args = _loads_or_str(args)
    return {"name": name, "arguments": json.dumps(args if args is not None else {}, ensure_ascii=False)}


def parse_calls(text: str, fmt: ToolFormat) -> list[dict] | None:
    """The calls in one call body (JSON object, array of objects, `name[ARGS]{...}`, or `;`-separated
    objects); None when it is not a valid call."""
    s = text.strip()
    if not s:
        return None
    if fmt.name == "mistral" and "[ARGS]" in s and not s.startswith(("{", "[")):
        name, _, args = s.partition("[ARGS]")
        try:
            return [{"name": name.strip(), "arguments": json.dumps(json.loads(args), ensure_ascii=False)}]
        except ValueError:
            return None
    dec = json.JSONDecoder()
    calls, i = [], 0
    while i < len(s):
        try:
            obj, j = dec.raw_decode(s, i)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        for it in items:
            c = _parse_call_obj(it, fmt)
            if c is None:
                return None
            calls.append(c)
        i = j
        while i < len(s) and s[i] in " \t\r\n;,":
            i += 1
    return calls or None


class OutputParser:
    """Splits generated text into reasoning, content and tool calls, incrementally.

    feed(text) and finish() return lists of ("reasoning", str) / ("content", str) / ("tool_call", dict) items.
    """

    def __init__(self, fmt: ToolFormat | None, reasoning: bool = False, in_reasoning: bool = False,
                 think_start: str = "<think>", think_end: str = "</think>"):
        self.fmt = fmt                  # None: tool calls are not parsed
        self.reasoning = reasoning
        self.think_start, self.think_end = think_start, think_end
        self.state = "reasoning" if (reasoning and in_reasoning) else "content"
        self.buf = ""
        self.seen_content = False       # any non-space content emitted (llama3 bare JSON must come first)
        self.calls: list[dict] = []
        self._after_think = False       # drop the newlines between </think> and the answer

    def _markers(self) -> list[tuple[str, str]]:
        ms = []
        if self.state == "reasoning":
            ms.append((self.think_end, "end_think"))
            return ms
        if self.reasoning and not self.seen_content:
            ms.append((self.think_start, "start_think"))
        if self.fmt is not None:
            ms.append((self.fmt.start, "call"))
        return ms

    def feed(self, text: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.buf += text
        while True:
            if self.state == "call":
                if not self._feed_call(out):
                    break
                continue
            if self.fmt is not None and self.fmt.name == "llama3" and self.state == "content" \
                    and not self.seen_content and self.buf.lstrip().startswith("{"):
                self.state = "call"          # bare JSON call: wait for the whole output
                self.buf = self.buf.lstrip()
                continue
            ms = self._markers()
            hit = None
            for marker, kind in ms:
                i = self.buf.find(marker)
                if i != -1 and (hit is None or i < hit[0]):
                    hit = (i, marker, kind)
            if hit is None:
                hold = max((_partial_suffix(self.buf, m) for m, _ in ms), default=0)
                if self.state == "content" and self.fmt is not None and self.fmt.name == "llama3" \
                        and not self.seen_content and not self.buf.strip():
                    hold = len(self.buf)
                emit, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                self._emit(out, emit)
                break
            i, marker, kind = hit
            self._emit(out, self.buf[:i])
            self.buf = self.buf[i + len(marker):]
            if kind == "start_think":
                self.state = "reasoning"
            elif kind == "end_think":
                self.state = "content"
                self._after_think = True
            else:
                self.state = "call"
        return out

    def _emit(self, out, text: str) -> None:
        if not text:
            return
        kind = "reasoning" if self.state == "reasoning" else "content"
        if kind == "content" and self._after_think:
            text = text.lstrip("\n")
            if not text:
                return
            self._after_think = False
        if kind == "content":
            if text.strip():
                self.seen_content = True
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _feed_call(self, out) -> bool:
        """In a call body: complete it when the end marker arrives. True if the state changed."""
        end = self.fmt.end
        if not end:
            return False                 # runs to the end of the output
        i = self.buf.find(end)
        if i == -1:
            return False
        body, self.buf = self.buf[:i], self.buf[i + len(end):]
        self._finish_call(out, body, self.fmt.start + body + end)
        self.state = "content"
        return True

    def _finish_call(self, out, body: str, raw: str) -> None:
        calls = parse_calls(body, self.fmt)
        if calls is None:
            self.state = "content"
            self._emit(out, raw)         # not a valid call: the client sees the text as it was
            return
        for c in calls:
            c = {"id": new_call_id(), **c}
            self.calls.append(c)
            out.append(("tool_call", c))

    def finish(self, truncated: bool = False) -> list[tuple[str, object]]:
        """What is left at the end of the output. `truncated` (the output was cut by max_tokens): a call that
        is still open is dropped rather than shown as text, since a half call is neither text nor a call."""
        out: list[tuple[str, object]] = []
        buf, self.buf = self.buf, ""
        if self.state == "call" and truncated:
            calls = parse_calls(buf, self.fmt) if not self.fmt.end else None
            for c in calls or []:
                c = {"id": new_call_id(), **c}
                self.calls.append(c)
                out.append(("tool_call", c))
            return out
        if self.state == "call":
            start = self.fmt.start if not (self.fmt.name == "llama3" and not buf.startswith(self.fmt.start)) else ""
            self._finish_call(out, buf, start + buf)
        elif buf:
            self._emit(out, buf)
        return out

    @staticmethod
    def collect(items) -> tuple[str, str, list[dict]]:
        reasoning, content, calls = [], [], []
        for kind, v in items:
            (reasoning if kind == "reasoning" else content if kind == "content" else calls).append(v)
        return "".join(reasoning), "".join(content), calls
