"""Turns user prompts into token ids and sampling parameters, and engine outputs back into `Response`s."""
from __future__ import annotations

from dataclasses import dataclass

from ..messages import GenerationConfig, Response
from ..pytorch.engine.request import EngineOutput
from ..pytorch.messages import SamplingParams
from .bounded_encode import encode_within
from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer
from .vision.prompt import is_image_tuple

Prompt = str | list[int] | list[dict] | tuple


def is_single_prompt(prompts) -> bool:
    """A str, a list of token ids, a list of chat messages, or a `(text, images)` tuple is one prompt; any other
    list is a batch."""
    if isinstance(prompts, str) or is_image_tuple(prompts):
        return True
    if isinstance(prompts, list | tuple):
        return len(prompts) == 0 or all(isinstance(p, int) for p in prompts) or all(
            isinstance(p, dict) for p in prompts)
    raise ValueError(f'a prompt must be a str, a list of token ids or a list of messages, got {type(prompts)}')


@dataclass(frozen=True)
class TemplateOptions:
    """What a chat request adds to its messages when the template renders them."""
    tools: list[dict] | None = None
    # Passed to the template as variables (`enable_thinking`, `preserve_thinking`, ...).
    kwargs: dict | None = None


_RESERVED_TEMPLATE_KWARGS = ('messages', 'tools', 'add_generation_prompt', 'tokenize', 'chat_template')


def render_chat(tokenizer: Tokenizer, messages: list[dict], template: TemplateOptions | None) -> str:
    template = template or TemplateOptions()
    kwargs = dict(template.kwargs or {})
    clash = [k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS or not isinstance(k, str)]
    if clash:
        raise ValueError(f'chat_template_kwargs may not set {clash}')
    return tokenizer.apply_chat_template(messages, tools=template.tools, **kwargs)


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt, do_preprocess: bool = True,
                  template: TemplateOptions | None = None,
                  max_tokens: int | None = None) -> tuple[list[int], str | None]:
    """Token ids of `prompt` and the text they were encoded from (None for a prompt given as token ids). With
    `max_tokens`, a text far longer than that is refused (`PromptTooLong`) before it is tokenized whole (the exact
    length check is the engine's)."""
    def encode(text: str, add_special_tokens: bool) -> list[int]:
        if max_tokens is None:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return encode_within(tokenizer, text, max_tokens, add_special_tokens)

    if isinstance(prompt, str):
        if not prompt:
            raise ValueError('the prompt is empty')
        if do_preprocess:
            text = render_chat(tokenizer, [{'role': 'user', 'content': prompt}], template)
            return encode(text, False), text
        return encode(prompt, True), prompt
    if isinstance(prompt, list | tuple) and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return list(prompt), None
    if isinstance(prompt, list | tuple) and not prompt:
        raise ValueError('the prompt is empty')
    if isinstance(prompt, list | tuple) and all(isinstance(m, dict) for m in prompt):
        for message in prompt:
            if 'role' not in message or ('content' not in message and 'tool_calls' not in message):
                raise ValueError(f"each message needs 'role' and 'content', got {message!r}")
        text = render_chat(tokenizer, list(prompt), template)
        return encode(text, False), text
    raise ValueError(f'unsupported prompt: {prompt!r:.80}')


def make_sampling_params(gen: GenerationConfig, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...],
                         vocab_size: int, grammar: object | None = None) -> SamplingParams:
    """Validated engine parameters: `GenerationConfig.validate` (types and ranges of the user's fields), then
    `SamplingParams.validate` (the ranges the sampling kernels accept, the vocabulary)."""
    gen.validate()
    stop_ids = list(gen.stop_token_ids or ())
    if not gen.ignore_eos:
        stop_ids += [t for t in eos_token_ids if t not in stop_ids]
    stop_sequences = tokenizer.stop_sequences(gen.stop_words)
    stop_ids += [s[0] for s in stop_sequences if len(s) == 1 and s[0] not in stop_ids]
    params = SamplingParams(
        max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
        temperature=gen.temperature if gen.do_sample else 0.0, top_p=gen.top_p, top_k=gen.top_k,
        repetition_penalty=gen.repetition_penalty, stop_token_ids=tuple(stop_ids),
        stop_sequences=tuple(s for s in stop_sequences if len(s) > 1), random_seed=gen.random_seed,
        logprobs=gen.logprobs, presence_penalty=gen.presence_penalty, frequency_penalty=gen.frequency_penalty,
        min_p=gen.min_p, logit_bias=tuple(sorted((gen.logit_bias or {}).items())),
        return_routed_experts=gen.return_routed_experts, grammar=grammar)
    params.validate(vocab_size)
    return params


class ResponseBuilder:
    """Accumulates one request's engine outputs; `update` returns the incremental `Response`.

    The request is `finished` when the engine finished it or when a stop string completed. A stop string is matched
    on the text, which the engine does not see: once it completes, `take_abort()` says (once) that the caller must
    abort the engine request. Tokens after the one that completed the stop string are dropped, so
    `generate_token_len` counts up to that token. A request that asked for routed experts does not finish there:
    the text before the stop string goes out at once, and the final response (`finish_reason` 'stop', no text)
    waits for the engine's final output, which carries the routes.

    Routed experts on the final response are rows `[0, input_len + generate_token_len - 1)`, whatever ended the
    request: the rows of every returned token but the last (its forward, if the engine ran it before the abort,
    sampled a dropped token, as the forward after an EOS would), never rows of dropped tokens.
    """

    def __init__(self, tokenizer: Tokenizer, input_len: int, gen: GenerationConfig, index: int = 0):
        self.detok = IncrementalDetokenizer(tokenizer, gen.stop_words)
        self.input_len = input_len
        self.index = index
        self.wants_routes = gen.return_routed_experts
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = [] if gen.logprobs is not None else None
        self.cached_tokens = 0
        self.finish_reason = None
        self.engine_finished = False
        self.error: str | None = None
        self.text = ''
        self.routed_experts = None
        self._abort_taken = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_abort(self) -> bool:
        """True once, after a stop string completed while the engine still runs the request: abort it then."""
        if self.detok.stopped and not self.engine_finished and not self._abort_taken:
            self._abort_taken = True
            return True
        return False

    def update(self, out: EngineOutput) -> Response | None:
        """The new part of the response; None for outputs after the request finished (or, after a stop string,
        for the engine's outputs before its final one)."""
        if self.finished or (self.detok.stopped and not out.finished):
            self.engine_finished = self.engine_finished or out.finished
            return None
        if self.detok.stopped:  # the engine's final output after a stop string: only its routes are new
            return self._finish(out, '', [], [] if self.logprobs is not None else None)
        before = self.detok.num_tokens
        delta = self.detok.update(out.new_token_ids, final=out.finished)
        new_ids = list(out.new_token_ids[:self.detok.num_tokens - before])
        new_logprobs = list(out.logprobs or [])[:len(new_ids)] if self.logprobs is not None else None
        self.token_ids += new_ids
        if new_logprobs:
            self.logprobs += new_logprobs
        self.cached_tokens = out.num_cached
        self.error = out.error or self.error
        self.text += delta
        if out.finished or (self.detok.stopped and not self.wants_routes):
            return self._finish(out, delta, new_ids, new_logprobs)
        return Response(text=delta, generate_token_len=len(self.token_ids), input_token_len=self.input_len,
                        token_ids=new_ids, cached_tokens=self.cached_tokens, logprobs=new_logprobs,
                        index=self.index, error=out.error)

    def _finish(self, out: EngineOutput, delta: str, new_ids: list[int], new_logprobs) -> Response:
        self.engine_finished = out.finished
        self.error = out.error or self.error
        self.finish_reason = 'stop' if self.detok.stopped else out.finish_reason
        if out.finished and out.routed_experts is not None:
            self.routed_experts = out.routed_experts[:self.input_len + len(self.token_ids) - 1]
        return Response(text=delta, generate_token_len=len(self.token_ids), input_token_len=self.input_len,
                        finish_reason=self.finish_reason, token_ids=new_ids, cached_tokens=self.cached_tokens,
                        logprobs=new_logprobs, index=self.index, error=out.error,
                        routed_experts=self.routed_experts)

    def final(self) -> Response:
        return Response(text=self.text, generate_token_len=len(self.token_ids), input_token_len=self.input_len,
                        finish_reason=self.finish_reason, token_ids=list(self.token_ids),
                        cached_tokens=self.cached_tokens, logprobs=self.logprobs, index=self.index, error=self.error,
                        routed_experts=self.routed_experts)
