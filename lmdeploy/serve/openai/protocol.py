"""OpenAI wire format: the request and response records of /v1/chat/completions, /v1/completions and /v1/models
(the requests here, the responses in `protocol_responses.py`, re-exported here).

Requests check types and ranges here (pydantic errors become 400s in the server); what only the engine can judge
(prompt length against the session, token ids against the vocabulary) is checked by `AsyncEngine.prepare`.
Unknown OpenAI fields (`user`, `metadata`, ...) are accepted and ignored; known features the engine lacks
(`echo`, `best_of`, `suffix`) are rejected with a message.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from ...messages import GenerationConfig, StructuredOutput

# the response records live in protocol_responses.py; importable from here like the requests
from .protocol_responses import (  # noqa: F401 - re-exported
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCallOut,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RoutedExpertsData,
    RoutedExpertsField,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
)

SEED_RANGE = (-2**63, 2**64 - 1)
MAX_N = 128          # choices per prompt
MAX_CHOICES = 256    # choices per request (prompts x n)


def new_id(prefix: str) -> str:
    return f'{prefix}-{uuid.uuid4().hex}'


def now() -> int:
    return int(time.time())


def _encodable(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); they are not Unicode text and no tokenizer can encode them.
    try:
        text.encode('utf-8')
    except UnicodeEncodeError as exc:
        raise ValueError(f'the text is not valid Unicode (a lone surrogate at position {exc.start})') from None
    return text


# User text: a JSON string (no coercion) that is valid Unicode.
Text = Annotated[StrictStr, AfterValidator(_encodable)]


class _Record(BaseModel):
    # strict: JSON types are not coerced ("10" is not an int, 1 is not a bool), as the OpenAI API rejects them;
    # NaN and Infinity (which Python's JSON parser accepts) are not numbers a sampler can use.
    model_config = ConfigDict(extra='ignore', strict=True, allow_inf_nan=False)


class StreamOptions(_Record):
    include_usage: bool = False


# ---- requests --------------------------------------------------------------------------------------------------
class JsonSchemaFormat(_Record):
    name: Text | None = None
    description: Text | None = None
    # The JSON Schema (OpenAI's field name is `schema`, which pydantic reserves: aliased).
    json_schema: dict[str, Any] = Field(alias='schema')
    strict: bool | None = None


class ResponseFormat(_Record):
    """OpenAI's `response_format`, plus LMDeploy's `regex_schema` type."""
    type: Literal['text', 'json_object', 'json_schema', 'regex_schema']
    json_schema: JsonSchemaFormat | None = None
    regex_schema: Text | None = None

    @model_validator(mode='after')
    def _has_its_spec(self) -> ResponseFormat:
        if self.type == 'json_schema' and self.json_schema is None:
            raise ValueError('response_format of type json_schema needs json_schema.schema')
        if self.type == 'regex_schema' and not self.regex_schema:
            raise ValueError('response_format of type regex_schema needs regex_schema')
        return self


class _SamplingRequest(_Record):
    """Fields shared by chat and text completions; `None` means the OpenAI default."""
    model: Text | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    # token id (as a string, as OpenAI sends it) -> bias added to its logit
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM / LMDeploy names).
    top_k: int = Field(0, ge=-1, description='0 or -1: off')
    min_p: float = Field(0.0, ge=0, le=1, description='0: off')
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    # The experts each MoE layer routed every position to, in the final chunk / response (LMDeploy's name).
    return_routed_experts: bool = False
    # Structured output: OpenAI's `response_format`, or vLLM's `guided_json` / `guided_regex` / `guided_grammar`.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: Text | None = Field(None, min_length=1)
    guided_grammar: Text | None = Field(None, min_length=1)

    @model_validator(mode='after')
    def _one_constraint(self) -> _SamplingRequest:
        given = [name for name in ('guided_json', 'guided_regex', 'guided_grammar') if getattr(self, name)]
        if self.response_format is not None and self.response_format.type != 'text':
            given.append('response_format')
        if len(given) > 1:
            raise ValueError(f'give at most one structured-output constraint, got {given}')
        return self

    def structured_output(self) -> StructuredOutput | None:
        fmt = self.response_format
        if fmt is not None and fmt.type == 'json_object':
            return StructuredOutput('json_object')
        if fmt is not None and fmt.type == 'json_schema':
            return StructuredOutput('json_schema', json.dumps(fmt.json_schema.json_schema))
        if fmt is not None and fmt.type == 'regex_schema':
            return StructuredOutput('regex', fmt.regex_schema)
        if self.guided_json is not None:
            return StructuredOutput('json_schema', json.dumps(self.guided_json))
        if self.guided_regex:
            return StructuredOutput('regex', self.guided_regex)
        if self.guided_grammar:
            return StructuredOutput('grammar', self.guided_grammar)
        return None

    @field_validator('logit_bias')
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f'logit_bias keys are token ids, got {key!r}')
            if not -100 <= value <= 100:
                raise ValueError(f'logit_bias values must be in [-100, 100], got {value!r} for {key}')
        return bias

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def with_defaults(self, defaults: dict) -> _SamplingRequest:
        """A copy with the model's sampling defaults in the fields the client did not send."""
        unset = {k: v for k, v in defaults.items() if k in type(self).model_fields and k not in self.model_fields_set}
        if 'top_k' in unset and unset['top_k'] < 0:
            unset['top_k'] = 0
        return self.model_copy(update=unset) if unset else self

    def generation_config(self, logprobs: int | None) -> GenerationConfig:
        """`max_new_tokens` is left for the server: it is `max_tokens` clamped to what the session leaves."""
        temperature = 1.0 if self.temperature is None else self.temperature
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return GenerationConfig(
            min_new_tokens=self.min_tokens,
            do_sample=temperature > 0, temperature=temperature or 1.0,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k, 0),
            repetition_penalty=self.repetition_penalty, stop_words=stop or None, ignore_eos=self.ignore_eos,
            random_seed=self.seed, logprobs=logprobs, n=self.num_choices,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            min_p=self.min_p, logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            return_routed_experts=self.return_routed_experts, structured_output=self.structured_output())


class TextContentPart(_Record):
    type: Literal['text']
    text: Text


class ImageURL(_Record):
    url: Text  # http(s), data:image/...;base64, or (allow-listed) file:// URL
    detail: Literal['auto', 'low', 'high'] | None = None


class ImageContentPart(_Record):
    type: Literal['image_url']
    image_url: ImageURL


class VideoContentPart(_Record):
    """Accepted by the schema so the request gets a clear 'not supported' error instead of a schema error."""
    type: Literal['video_url', 'input_video']
    video_url: dict[str, Any] | None = None


ContentPart = Annotated[TextContentPart | ImageContentPart | VideoContentPart, Field(discriminator='type')]


class FunctionCall(_Record):
    name: Text
    arguments: Text = '{}'  # JSON, as the model wrote it


class ToolCallMessage(_Record):
    """An assistant's tool call in the history."""
    id: str | None = None
    type: Literal['function'] = 'function'
    function: FunctionCall

    def as_template_call(self) -> dict:
        # Templates expect `arguments` as a mapping (Qwen3.5 iterates its items); text that is not a JSON object
        # stays text, which Qwen3's template prints as is.
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {'id': self.id, 'type': 'function',
                'function': {'name': self.function.name, 'arguments': arguments}}


class ChatMessage(_Record):
    role: Literal['system', 'developer', 'user', 'assistant', 'tool']
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    def as_template_message(self) -> dict:
        """The message as Hugging Face chat templates take it: `content` a string, or a list of text and image
        parts when the message has images (the template writes one image placeholder per image part)."""
        content = self.content
        if not isinstance(content, str):
            parts = content or ()
            if all(isinstance(p, TextContentPart) for p in parts):
                content = ''.join(p.text for p in parts)
            else:
                content = [p.model_dump(exclude_none=True) for p in parts]
        message: dict[str, Any] = {'role': 'system' if self.role == 'developer' else self.role, 'content': content}
        if self.tool_calls:
            message['tool_calls'] = [call.as_template_call() for call in self.tool_calls]
        for key in ('name', 'tool_call_id', 'reasoning_content'):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class FunctionDefinition(_Record):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Record):
    type: Literal['function']
    function: FunctionDefinition


class NamedFunction(_Record):
    name: Text


class NamedToolChoice(_Record):
    type: Literal['function']
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)  # upper bound: --max-logprobs (limits.py)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal['none', 'auto', 'required'] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extension (vLLM / LMDeploy): variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode='after')
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError('top_logprobs requires logprobs=true')
        return self

    @model_validator(mode='after')
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        if self.tool_choice == 'required' and not self.tools:
            raise ValueError('tool_choice "required" needs tools')
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f'tool_choice names the function {name!r}, which is not in tools')
        return self

    def template_tools(self) -> list[dict] | None:
        """The tools the template shows the model: none for tool_choice "none", only the named one if named."""
        if not self.tools or self.tool_choice == 'none':
            return None
        tools = self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        return [t.model_dump(exclude_none=True) for t in tools]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_generation_config(self) -> GenerationConfig:
        return self.generation_config(self.num_logprobs)

    def prompt(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)  # upper bound: --max-logprobs (limits.py)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode='after')
    def _bounded_choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.num_choices > MAX_CHOICES:
            raise ValueError(f'{len(self.prompts())} prompts x n={self.num_choices} exceed {MAX_CHOICES} choices')
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batch (a string or a token-id list is one prompt); choice i*n+j is prompt i's j-th."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)
        return [prompt]

    @model_validator(mode='after')
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError('echo is not supported')
        if self.best_of not in (None, 1):
            raise ValueError('best_of > 1 is not supported')
        if self.suffix:
            raise ValueError('suffix is not supported')
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_generation_config(self) -> GenerationConfig:
        return self.generation_config(self.logprobs)
