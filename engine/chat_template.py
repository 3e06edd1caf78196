"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja) the way Hugging Face transformers does.

The environment mirrors transformers' `_compile_jinja_template`: an ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and the loopcontrols extension; the globals `raise_exception` and
`strftime_now`; a `tojson` filter that is plain `json.dumps` (ensure_ascii=False, no HTML escaping);
and the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools` plus whatever
extra keyword arguments the caller passes (e.g. `enable_thinking`, `documents`).

A model without a template gets a fallback chosen by its vocabulary (fallback_for): Gemma's turn format when
`<start_of_turn>`/`<end_of_turn>` are tokens, Llama 3's when its header tokens are, else ChatML (llama.cpp's
default). The fallback's end markers (`stop_strings`) end a reply, so no turn marker leaks into the text.

`render(..., continue_final_message=True)` continues the last (assistant) message instead of opening a new
turn: the rendering is cut right after that message's text, as transformers does (assistant prefill).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML_TEMPLATE", "GEMMA_TEMPLATE", "LLAMA3_TEMPLATE",
           "FALLBACKS", "fallback_for"]


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered, or the messages are malformed."""


# Used when the model has no template. Handles content given as a list of parts (text parts joined).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A message's text: the string, or its text parts joined.
_TEXT_MACRO = (
    "{% macro text(m) %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] is iterable %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
)

# Gemma's turns: roles user and model, the system text at the head of the first user turn.
GEMMA_TEMPLATE = _TEXT_MACRO + (
    "{{ bos_token }}"
    "{% set ns = namespace(sys='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.sys = ns.sys + text(message) + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{% if message['role'] != 'assistant' %}{{ ns.sys }}{% set ns.sys = '' %}{% endif %}"
    "{{ text(message) | trim }}{{ '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = _TEXT_MACRO + (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}{{ text(message) | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# name -> (source, end markers that stop a reply, tokens the vocabulary must have for it to be chosen)
FALLBACKS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "gemma": (GEMMA_TEMPLATE, ("<end_of_turn>", "<start_of_turn>"), ("<start_of_turn>", "<end_of_turn>")),
    "llama3": (LLAMA3_TEMPLATE, ("<|eot_id|>", "<|start_header_id|>"), ("<|start_header_id|>", "<|eot_id|>")),
    "chatml": (CHATML_TEMPLATE, ("<|im_end|>", "<|im_start|>"), ()),
}


def fallback_for(is_token) -> str:
    """The fallback template's name for a model without one: the first of FALLBACKS whose turn markers are
    single tokens of its vocabulary (`is_token(text) -> bool`); ChatML otherwise."""
    for name, (_, _, needs) in FALLBACKS.items():
        if needs and all(is_token(t) for t in needs):
            return name
    return "chatml"


# Content part types we accept inside a message's `content` list.
_PART_TYPES = {"text", "image", "image_url", "audio", "input_audio", "video"}


def _raise_exception(message: Any = "") -> None:
    raise ChatTemplateError(f"chat template raised an exception: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Like transformers: unlike Jinja's built-in tojson, no HTML escaping and non-ASCII kept as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some HF templates to mark assistant text).

    transformers uses it to build an assistant-token mask; for rendering it is a no-op wrapper.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _SandboxEnv(ImmutableSandboxedEnvironment):
    """Stricter than Jinja's default sandbox: touching an unsafe attribute fails at once.

    Jinja returns an Undefined for e.g. `''.__class__` and only raises when that value is used further,
    so `{{ ''.__class__ }}` would quietly print nothing; here any such access raises SecurityError.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe.")


def _make_env() -> ImmutableSandboxedEnvironment:
    env = _SandboxEnv(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _validate_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where} needs a non-empty string 'role', got {role!r}")
        if "content" not in m:
            # An assistant turn that only calls tools may omit content (OpenAI allows this).
            if role == "assistant" and m.get("tool_calls"):
                continue
            raise ChatTemplateError(f"{where} (role {role!r}) has no 'content'")
        content = m["content"]
        if content is None or isinstance(content, str):
            continue
        if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
            raise ChatTemplateError(
                f"{where}.content must be a string, null or a list of parts, got {type(content).__name__}")
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            if not isinstance(part, Mapping):
                raise ChatTemplateError(f"{pwhere} must be a dict with a 'type', got {type(part).__name__}")
            ptype = part.get("type")
            if ptype not in _PART_TYPES:
                raise ChatTemplateError(
                    f"{pwhere} has unsupported type {ptype!r} (expected one of {sorted(_PART_TYPES)})")
            if ptype == "text" and not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"{pwhere} is a text part without a string 'text'")


def _validate_tools(tools: Any) -> None:
    if tools is None:
        return
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ChatTemplateError(f"tools must be a list of dicts, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ChatTemplateError(f"tools[{i}] must be a dict (a JSON schema), got {type(t).__name__}")


class ChatTemplate:
    """A compiled chat template. `ChatTemplate(None)` (or "") gives the fallback named by `fallback` (one of
    FALLBACKS; ChatML by default). `name` is "gguf" for the model's own template, else the fallback's name;
    `stop_strings` are the fallback's end markers (none for the model's own template)."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "", fallback: str = "chatml"):
        self.is_fallback: bool = not source
        if self.is_fallback:
            self.name = fallback
            source, self.stop_strings, _ = FALLBACKS[fallback]
        else:
            self.name, self.stop_strings = "gguf", ()
        self.source: str = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        if not isinstance(self.source, str):
            raise ChatTemplateError(f"chat template must be a string, got {type(self.source).__name__}")
        try:
            self._template = _make_env().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template could not be compiled: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, continue_final_message: bool = False, **extra: Any) -> str:
        _validate_messages(messages)
        _validate_tools(tools)
        if continue_final_message:
            return self._continue(messages, tools, extra)
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables.update(extra)
        variables["messages"] = messages
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        variables["tools"] = tools if tools else None
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
                OverflowError, RecursionError) as e:
            raise ChatTemplateError(
                f"chat template failed to render ({type(e).__name__}: {e}); "
                "the messages may not have the shape this template expects") from e

    def _continue(self, messages: list[dict], tools, extra: dict) -> str:
        """The conversation rendered so that generation continues the final message's text."""
        final = messages[-1] if messages else None
        if not final or final.get("role") != "assistant":
            raise ChatTemplateError("continue_final_message needs an assistant message last")
        content = final.get("content")
        if not isinstance(content, str):
            content = "".join(p.get("text", "") for p in content or [] if isinstance(p, Mapping)
                              and p.get("type") == "text")
        rendered = self.render(messages, add_generation_prompt=False, tools=tools, **extra)
        for probe in (content, content.rstrip(), content.strip()):
            if probe and probe in rendered:
                return rendered[:rendered.rindex(probe) + len(probe)]
        if not content.strip():
            return self.render(messages[:-1], add_generation_prompt=True, tools=tools, **extra)
        raise ChatTemplateError("the chat template does not render the final assistant message's text, so it "
                                "cannot be continued")

    def __repr__(self) -> str:
        kind = f"{self.name} fallback" if self.is_fallback else f"{len(self.source)} chars"
        return f"ChatTemplate({kind})"
