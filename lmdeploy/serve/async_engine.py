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
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..messages import GenerationConfig, PytorchEngineConfig, Response
from ..pytorch.engine.engine import Engine
from ..pytorch.engine.engine_loop import EngineLoop
from ..pytorch.engine.gc_freeze import freeze_heap, release_heap
from ..pytorch.engine.request import EngineOutput
from ..pytorch.messages import SEED_RANGE, MultiModalSpan, SamplingParams
from ..pytorch.models.model_source import is_hub_id, resolve_model_path
from .request_builder import Prompt, ResponseBuilder, TemplateOptions, encode_prompt, make_sampling_params
from .sampling_defaults import apply_to_generation_config, load_sampling_defaults
from .structured_output import GrammarCompiler
from .tokenizer import Tokenizer
from .vision.images import ImageLoadConfig, load_image
from .vision.processor import ImageProcessor
from .vision.prompt import image_sources, is_image_tuple, messages_of_image_tuple


@dataclass
class PreparedRequest:
    input_ids: list[int]
    gen_config: GenerationConfig
    index: int = 0
    # The rendered prompt (None when given as token ids): reasoning parsers look at how it ends.
    prompt_text: str | None = None
    # The prompt's images (placeholder ranges of `input_ids` with their pixels and content hashes).
    mm_spans: tuple[MultiModalSpan, ...] = ()
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
                 model_name: str | None = None, chat_template: str | None = None, generation_config: str = 'auto',
                 image_load_config: ImageLoadConfig | None = None):
        """`generation_config`: where default sampling parameters come from ('auto': the model's
        generation_config.json; 'none': the API's defaults; or a folder holding one). `image_load_config`: where
        images may come from (local files only under its allow-listed folder) and how large they may be; it
        matters for vision-language checkpoints only."""
        # a hub id is served under its full name (`Qwen/Qwen3.5-9B`, as vLLM does), a folder under its base name
        self.model_name = model_name or (model_path if is_hub_id(model_path) else model_path.rstrip('/').split('/')[-1])
        # the engine first: it resolves the model (one-line `ModelNotFoundError`) and names a bad folder
        self.engine = Engine(model_path, backend_config)
        self.model_path = self.engine.model_path  # the local folder
        tokenizer = self.engine.engine_config.tokenizer
        tokenizer_path = resolve_model_path(tokenizer, with_weights=False) if tokenizer else self.model_path
        self.tokenizer = Tokenizer(tokenizer_path, chat_template)
        self.sampling_defaults = load_sampling_defaults(self.model_path, generation_config)
        image_token_id = self.engine.model_config.image_token_id
        self.image_processor = ImageProcessor(self.model_path, image_token_id) if image_token_id is not None else None
        self.image_load_config = image_load_config or ImageLoadConfig()
        self._loop = EngineLoop(self.engine)
        self._detokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix='lmdeploy-detokenizer')
        # seq_id -> (put a response into its astream, its ResponseBuilder), for `fail_requests`
        self._live: dict[int, tuple[Callable, ResponseBuilder]] = {}
        # the start-up heap out of the collector's full passes while this engine serves (`gc_freeze.py`)
        self._gc_frozen = freeze_heap()

    @property
    def session_len(self) -> int:
        return self.engine.session_len

    @property
    def adapter_names(self) -> list[str]:
        """Names of the resident LoRA adapters (what requests may pass as `adapter_name`)."""
        return list(self.engine.adapters)

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
        if is_image_tuple(prompt):
            prompt = messages_of_image_tuple(prompt)
        sources = image_sources(prompt)
        if sources and self.image_processor is None:
            raise ValueError('this model takes no images (its checkpoint has no vision tower)')
        images = [load_image(source, self.image_load_config) for source in sources]
        input_ids, text = encode_prompt(self.tokenizer, prompt, do_preprocess, template,
                                        max_tokens=self.session_len - 1)
        spans = ()
        if images:
            input_ids, spans = self.image_processor.expand(input_ids, images)
        self.engine.validate_prompt(input_ids)
        self.engine.validate_mm_spans(input_ids, spans)
        return PreparedRequest(input_ids, gen_config, index, text, spans)

    def validate_generation_config(self, gen_config: GenerationConfig) -> None:
        """Raise `ValueError` naming the first field the engine cannot serve (user, kernel and vocabulary ranges,
        routed experts without the engine flag; `UnknownAdapterError` for an adapter the engine has not loaded).
        Cheap: it compiles no grammar (`prepare` does)."""
        self.engine.validate_sampling(self._sampling_params(gen_config, with_grammar=False))
        self.engine.adapter_identity(gen_config.adapter_name)

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
        return self.engine.add_request(request.input_ids, self._sampling_params(request.gen_config), callback,
                                       adapter_name=request.gen_config.adapter_name, mm_spans=request.mm_spans)

    def abort(self, seq_id: int) -> None:
        self.engine.abort_request(seq_id)

    def stream(self, request: PreparedRequest) -> Iterator[Response]:
        """Incremental responses of one request (blocking); closing the iterator early aborts the request, and so
        does a stop string (the engine may have run a step past it; those tokens are dropped; a request that asked
        for routed experts gets its final response once the engine's abort output brought them)."""
        outputs: queue.Queue[EngineOutput] = queue.Queue()
        builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
        seq_id = self.submit(request, outputs.put)
        try:
            while not builder.finished:
                response = builder.update(outputs.get())
                if builder.take_abort():
                    self.abort(seq_id)
                if response is not None:
                    yield response
        finally:
            if not builder.engine_finished:
                self.abort(seq_id)

    async def astream(self, request: PreparedRequest,
                      on_first_step: Callable[[float], None] | None = None) -> AsyncIterator[Response]:
        """asyncio flavour of `stream`; cancellation (e.g. a client disconnect) aborts the request.

        Detokenization runs on the detokenizer thread, not on the event loop: outputs go engine thread ->
        detokenizer thread (one for all requests, so each request's outputs stay in order) -> event loop.
        `on_first_step(t)`: called with the `time.monotonic()` start of the engine step that produced the first
        output (when the request left the engine's queue, for a prompt prefilled in one step). `fail_requests` may
        end the stream from another thread.
        """
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue[Response | BaseException] = asyncio.Queue()
        builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
        first_step: list[float] = []

        def build(out: EngineOutput) -> None:  # on the detokenizer thread
            try:
                item = builder.update(out)
                if builder.take_abort():  # a stop string: the engine does not know (its abort output ends it)
                    self.abort(out.seq_id)
            except Exception as exc:  # handed to the request's own coroutine
                item = exc
            if item is not None:
                put(item)

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for it
                loop.call_soon_threadsafe(responses.put_nowait, item)

        def on_output(out: EngineOutput) -> None:  # on the engine thread, inside the step
            if not first_step:
                first_step.append(self._loop.step_started_at or time.monotonic())
            self._detokenizer.submit(build, out)

        seq_id = self.submit(request, on_output)
        self._live[seq_id] = (put, builder)
        finished = False
        try:
            while not finished:
                item = await responses.get()
                if isinstance(item, BaseException):
                    raise item
                if on_first_step is not None and first_step:
                    on_first_step(first_step[0])
                    on_first_step = None
                finished = item.finish_reason is not None
                yield item
        finally:
            self._live.pop(seq_id, None)
            if not builder.engine_finished:
                self.abort(seq_id)

    @property
    def engine_loop(self) -> EngineLoop:
        return self._loop

    @property
    def live_request_ids(self) -> list[int]:
        """Requests streaming through `astream` now."""
        return list(self._live)

    def fail_requests(self, seq_ids, finish_reason: str, error: str) -> int:
        """End these `astream` requests now, from any thread, with a final response carrying `finish_reason` and
        `error`, and abort them in the engine (which frees their blocks once it steps again). Returns how many were
        live."""
        failed = 0
        for seq_id in list(seq_ids):
            entry = self._live.pop(seq_id, None)
            if entry is None:
                continue
            put, builder = entry
            put(Response(text='', generate_token_len=len(builder.token_ids), input_token_len=builder.input_len,
                         finish_reason=finish_reason, cached_tokens=builder.cached_tokens, index=builder.index,
                         logprobs=[] if builder.logprobs is not None else None, error=error))
            self.abort(seq_id)
            failed += 1
        return failed

    def close(self) -> None:
        try:
            self._loop.close()
            self._detokenizer.shutdown(wait=True)
        finally:  # a failed close must not leave the heap frozen for the rest of the process
            release_heap(self._gc_frozen)
            self._gc_frozen = False
