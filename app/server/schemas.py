"""Request and response models (pydantic) for the OpenAPI schema and for validating request bodies.

Request models allow extra fields (clients send many we do not use); their declared fields carry the
ranges we accept, so a value out of range is rejected before it reaches the engine, with a 400 in the
API's own error shape (see app.py).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----------------------------------------------------------------------------------------------- errors
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape (every route except /v1/messages)."""
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape (/v1/messages)."""
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# ----------------------------------------------------------------------------------------------- OpenAI chat
class ImageURL(_Open):
    url: str = Field(max_length=50_000_000)
    detail: Optional[Literal["auto", "low", "high"]] = None


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Union[TextPart, ImagePart]


class FunctionCall(_Open):
    name: str
    arguments: str = "{}"


class ToolCall(_Open):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaFormat(_Open):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class StreamOptions(_Open):
    include_usage: Optional[bool] = None


class _SamplingFields(_Open):
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=-1, le=1_000_000)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, le=10)
    repeat_last_n: Optional[int] = Field(default=None, ge=-1, le=1_000_000)
    logit_bias: Optional[dict[str, float]] = None
    stop: Optional[Union[str, list[str]]] = None
    ignore_eos: Optional[bool] = None
    user: Optional[str] = Field(default=None, max_length=256)
    session: Optional[str] = Field(default=None, max_length=256)


class ChatCompletionRequest(_SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    n: Optional[int] = Field(default=1, ge=1, le=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    enable_thinking: Optional[bool] = None
    continue_final_message: Optional[bool] = Field(
        default=None, description="continue the last (assistant) message instead of starting a new turn")
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None


class CompletionRequest(_SamplingFields):
    model: str
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        description="text, a list of token ids, or a list of either (one choice per prompt, at most 64)")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    n: Optional[int] = Field(default=1, ge=1, le=1)
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: Optional[str] = None
    response_format: Optional[ResponseFormat] = None


# ----------------------------------------------------------------------------------------------- responses
class UsageDetails(BaseModel):
    cached_tokens: int = 0


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[UsageDetails] = None


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    finish_reason: Optional[str] = None
    logprobs: Optional[dict[str, Any]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    system_fingerprint: Optional[str] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[dict[str, Any]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    context_length: int
    capabilities: dict[str, bool]
    chat_template: Optional[str] = Field(default=None, description='"gguf" (the model\'s own) or '
                                         '"fallback:NAME" (the model file has none: gemma, llama3 or chatml)')


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: str
    model: Optional[str] = None


class TokenizeRequest(_Open):
    content: str = Field(max_length=10_000_000)
    add_special: Optional[bool] = False
    parse_special: Optional[bool] = True
    with_pieces: Optional[bool] = False


class TokenizeResponse(BaseModel):
    tokens: list[Any]


class DetokenizeRequest(_Open):
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    content: str


class SlotsResponse(BaseModel):
    slots: list[dict[str, Any]]
    running: int
    waiting: int


# ----------------------------------------------------------------------------------------------- Anthropic
class AnthropicImageSource(_Open):
    type: Literal["base64", "url"]
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None


class AnthropicBlock(_Open):
    """One content block: text, image, tool_use, tool_result, thinking (others are refused)."""
    type: Literal["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document"]
    text: Optional[str] = None
    source: Optional[AnthropicImageSource] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None


class AnthropicMessage(_Open):
    role: Literal["user", "assistant"]
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(_Open):
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None


class AnthropicToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class AnthropicThinking(_Open):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class AnthropicSystemBlock(_Open):
    type: Literal["text"]
    text: str


class MessagesRequest(_Open):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Optional[Union[str, list[AnthropicSystemBlock]]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    stop_sequences: Optional[list[str]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[AnthropicThinking] = None
    metadata: Optional[dict[str, Any]] = None


class CountTokensRequest(_Open):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[AnthropicSystemBlock]]] = None
    tools: Optional[list[AnthropicTool]] = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: Optional[int] = 0
    cache_creation_input_tokens: Optional[int] = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: AnthropicUsage
