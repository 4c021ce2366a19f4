"""AsyncEngine: tokenizer + engine + background loop, with sync and asyncio streaming front doors.

Owns one `Engine` and its `EngineLoop`. Each request's engine outputs arrive on the loop thread and are handed to
the caller through a thread-safe queue (sync) or `call_soon_threadsafe` (asyncio). Validation errors are raised
in the caller's thread before anything is queued.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..messages import GenerationConfig, PytorchEngineConfig, Response
from ..pytorch.engine.engine import Engine
from ..pytorch.engine.engine_loop import EngineLoop
from ..pytorch.engine.request import EngineOutput
from ..pytorch.messages import SEED_RANGE, SamplingParams
from .request_builder import Prompt, ResponseBuilder, TemplateOptions, encode_prompt, make_sampling_params
from .sampling_defaults import apply_to_generation_config, load_sampling_defaults
from .structured_output import GrammarCompiler
from .tokenizer import Tokenizer


@dataclass
class PreparedRequest:
    input_ids: list[int]
    gen_config: GenerationConfig
    index: int = 0
    # The rendered prompt (None when given as token ids): reasoning parsers look at how it ends.
    prompt_text: str | None = None
    # `n` of the user's config (each choice's own config has n=1).
    requested_n: int = 1


def choice_requests(request: PreparedRequest, first_index: int = 0) -> list[PreparedRequest]:
    """The `gen_config.n` independent samples of one prepared prompt, indexed from `first_index`; with a seed,
    sample j is seeded with seed + j (wrapped into the seed range), so a seeded batch is reproducible."""
    gen = request.gen_config
    out = []
    for j in range(gen.n):
        seed = gen.random_seed
        if seed is not None and j:
            seed = seed + j if seed + j <= SEED_RANGE[1] else seed + j - 2**64
        out.append(replace(request, gen_config=replace(gen, random_seed=seed, n=1), index=first_index + j,
                           requested_n=gen.n))
    return out


class AsyncEngine:

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | None = None,
                 model_name: str | None = None, chat_template: str | None = None, generation_config: str = 'auto'):
        """`generation_config`: where default sampling parameters come from ('auto': the model's
        generation_config.json; 'none': the API's defaults; or a folder holding one)."""
        self.model_path = model_path
        self.model_name = model_name or model_path.rstrip('/').split('/')[-1]
        # the engine first: it names a bad model folder with a ValueError, the tokenizer with a hub error
        self.engine = Engine(model_path, backend_config)
        self.tokenizer = Tokenizer(model_path, chat_template)
        self.sampling_defaults = load_sampling_defaults(model_path, generation_config)
        self._loop = EngineLoop(self.engine)
        self._detokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix='lmdeploy-detokenizer')

    @property
    def session_len(self) -> int:
        return self.engine.session_len

    def prepare(self, prompt: Prompt, gen_config: GenerationConfig | None = None, do_preprocess: bool = True,
                index: int = 0, template: TemplateOptions | None = None) -> PreparedRequest:
        """Tokenize, validate and compile the request's grammar (if any, into the cache `submit` reads); raises
        `ValueError` naming the problem. The server runs it in a worker thread."""
        if gen_config is None:
            gen_config = GenerationConfig()
            apply_to_generation_config(gen_config, self.sampling_defaults)
        self.validate_generation_config(gen_config)
        if gen_config.structured_output is not None:
            self.grammars.compile(gen_config.structured_output)
        input_ids, text = encode_prompt(self.tokenizer, prompt, do_preprocess, template,
                                        max_tokens=self.session_len - 1)
        self.engine.validate_prompt(input_ids)
        return PreparedRequest(input_ids, gen_config, index, text)

    def validate_generation_config(self, gen_config: GenerationConfig) -> None:
        """Raise `ValueError` naming the first field the engine cannot serve (user, kernel and vocabulary ranges,
        routed experts without the engine flag). Cheap: it compiles no grammar (`prepare` does)."""
        self.engine.validate_sampling(self._sampling_params(gen_config, with_grammar=False))

    @property
    def _eos_token_ids(self) -> tuple[int, ...]:
        eos = tuple(self.engine.model_config.eos_token_ids)
        return eos or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        return GrammarCompiler(self.tokenizer.hf_tokenizer, self.engine.model_config.vocab_size, self._eos_token_ids)

    def _sampling_params(self, gen_config: GenerationConfig, with_grammar: bool = True) -> SamplingParams:
        """Validated engine parameters; a grammar is compiled here (cached: `prepare`, in the caller's or a worker
        thread, compiles it; `submit` finds it in the cache)."""
        gen_config.validate()
        grammar = None
        if with_grammar and gen_config.structured_output is not None:
            grammar = self.grammars.compile(gen_config.structured_output)
        return make_sampling_params(gen_config, self.tokenizer, self._eos_token_ids,
                                    self.engine.model_config.vocab_size, grammar)

    def submit(self, request: PreparedRequest, callback) -> int:
        return self.engine.add_request(request.input_ids, self._sampling_params(request.gen_config), callback)

    def abort(self, seq_id: int) -> None:
        self.engine.abort_request(seq_id)

    def stream(self, request: PreparedRequest) -> Iterator[Response]:
        """Incremental responses of one request (blocking); closing the iterator early aborts the request, and so
        does a stop string (the engine may have run a step past it; those tokens are dropped)."""
        outputs: queue.Queue[EngineOutput] = queue.Queue()
        builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
        seq_id = self.submit(request, outputs.put)
        try:
            while not builder.finished:
                response = builder.update(outputs.get())
                if response is not None:
                    yield response
        finally:
            if not builder.engine_finished:
                self.abort(seq_id)

    async def astream(self, request: PreparedRequest) -> AsyncIterator[Response]:
        """asyncio flavour of `stream`; cancellation (e.g. a client disconnect) aborts the request.

        Detokenization runs on the detokenizer thread, not on the event loop: outputs go engine thread ->
        detokenizer thread (one for all requests, so each request's outputs stay in order) -> event loop.
        """
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue[Response | BaseException] = asyncio.Queue()
        builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)

        def build(out: EngineOutput) -> None:  # on the detokenizer thread
            try:
                item = builder.update(out)
            except Exception as exc:  # handed to the request's own coroutine
                item = exc
            if item is not None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for it
                    loop.call_soon_threadsafe(responses.put_nowait, item)

        seq_id = self.submit(request, lambda out: self._detokenizer.submit(build, out))
        finished = False
        try:
            while not finished:
                item = await responses.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not builder.engine_finished:
                self.abort(seq_id)

    def close(self) -> None:
        self._loop.close()
        self._detokenizer.shutdown(wait=True)
