"""AsyncEngine: tokenizer + engine + background loop, with sync and asyncio streaming front doors.

Owns one `Engine` and its `EngineLoop`. Each request's engine outputs arrive on the loop thread and are handed to
the caller through a thread-safe queue (sync) or `call_soon_threadsafe` (asyncio). Validation errors are raised
in the caller's thread before anything is queued.
"""
from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from ..messages import GenerationConfig, PytorchEngineConfig, Response
from ..pytorch.engine.engine import Engine
from ..pytorch.engine.engine_loop import EngineLoop
from ..pytorch.engine.request import EngineOutput
from ..pytorch.messages import MultiModalSpan, SamplingParams
from .request_builder import Prompt, ResponseBuilder, TemplateOptions, encode_prompt, make_sampling_params
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


class AsyncEngine:

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | None = None,
                 model_name: str | None = None, chat_template: str | None = None,
                 image_load_config: ImageLoadConfig | None = None):
        """`image_load_config`: where images may come from (local files only under its allow-listed folder) and
        how large they may be; it matters for vision-language checkpoints only."""
        self.model_path = model_path
        self.model_name = model_name or model_path.rstrip('/').split('/')[-1]
        # the engine first: it names a bad model folder with a ValueError, the tokenizer with a hub error
        self.engine = Engine(model_path, backend_config)
        self.tokenizer = Tokenizer(model_path, chat_template)
        image_token_id = self.engine.model_config.image_token_id
        self.image_processor = ImageProcessor(model_path, image_token_id) if image_token_id is not None else None
        self.image_load_config = image_load_config or ImageLoadConfig()
        self._loop = EngineLoop(self.engine)

    @property
    def session_len(self) -> int:
        return self.engine.session_len

    def prepare(self, prompt: Prompt, gen_config: GenerationConfig | None = None, do_preprocess: bool = True,
                index: int = 0, template: TemplateOptions | None = None) -> PreparedRequest:
        """Tokenize and validate; raises `ValueError` naming the problem."""
        gen_config = gen_config or GenerationConfig()
        self.validate_generation_config(gen_config)
        if is_image_tuple(prompt):
            prompt = messages_of_image_tuple(prompt)
        sources = image_sources(prompt)
        if sources and self.image_processor is None:
            raise ValueError('this model takes no images (its checkpoint has no vision tower)')
        images = [load_image(source, self.image_load_config) for source in sources]
        input_ids, text = encode_prompt(self.tokenizer, prompt, do_preprocess, template)
        spans = ()
        if images:
            input_ids, spans = self.image_processor.expand(input_ids, images)
        self.engine.validate_prompt(input_ids)
        self.engine.validate_mm_spans(input_ids, spans)
        return PreparedRequest(input_ids, gen_config, index, text, spans)

    def validate_generation_config(self, gen_config: GenerationConfig) -> None:
        """Raise `ValueError` naming the first field the engine cannot serve (user, kernel and vocabulary ranges)."""
        self._sampling_params(gen_config)

    def _sampling_params(self, gen_config: GenerationConfig) -> SamplingParams:
        model_config = self.engine.model_config
        eos = tuple(model_config.eos_token_ids) or ((self.tokenizer.eos_token_id,)
                                                    if self.tokenizer.eos_token_id is not None else ())
        return make_sampling_params(gen_config, self.tokenizer, eos, model_config.vocab_size)

    def submit(self, request: PreparedRequest, callback) -> int:
        return self.engine.add_request(request.input_ids, self._sampling_params(request.gen_config), callback,
                                       mm_spans=request.mm_spans)

    def abort(self, seq_id: int) -> None:
        self.engine.abort_request(seq_id)

    def stream(self, request: PreparedRequest) -> Iterator[Response]:
        """Incremental responses of one request (blocking); closing the iterator early aborts the request."""
        outputs: queue.Queue[EngineOutput] = queue.Queue()
        builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
        seq_id = self.submit(request, outputs.put)
        finished = False
        try:
            while not finished:
                out = outputs.get()
                finished = out.finished
                yield builder.update(out)
        finally:
            if not finished:
                self.abort(seq_id)

    async def astream(self, request: PreparedRequest) -> AsyncIterator[Response]:
        """asyncio flavour of `stream`; cancellation (e.g. a client disconnect) aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[EngineOutput] = asyncio.Queue()
        builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
        seq_id = self.submit(request, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield builder.update(out)
        finally:
            if not finished:
                self.abort(seq_id)

    def close(self) -> None:
        self._loop.close()
