"""`Pipeline`: batch and streaming inference for Python users."""
from __future__ import annotations

import queue
from collections.abc import Iterator

from tqdm import tqdm

from ..messages import GenerationConfig, PytorchEngineConfig, Response
from .async_engine import AsyncEngine, choice_requests
from .request_builder import ResponseBuilder, is_single_prompt
from .vision.images import ImageLoadConfig

_TQDM_THRESHOLD = 16


class Pipeline:

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | None = None,
                 generation_config: str = 'auto', allowed_local_media_path: str | None = None):
        """`generation_config`: 'auto' takes the model's generation_config.json sampling parameters as the default
        when no `GenerationConfig` is given; 'none' keeps `GenerationConfig()`'s (greedy).
        `allowed_local_media_path`: the folder images may be read from by path or file:// URL (None: no local
        files; PIL images, data URLs and http(s) URLs are always accepted)."""
        self.async_engine = AsyncEngine(model_path, backend_config, generation_config=generation_config,
                                        image_load_config=ImageLoadConfig(allowed_local_media_path))
        self.tokenizer = self.async_engine.tokenizer
        self.engine = self.async_engine.engine

    def _prepare_all(self, prompts, gen_config, do_preprocess):
        single = is_single_prompt(prompts)
        items = [prompts] if single else list(prompts)
        if not items:
            raise ValueError('no prompts given')
        configs = gen_config if isinstance(gen_config, list) else [gen_config] * len(items)
        if len(configs) != len(items):
            raise ValueError(f'{len(configs)} generation configs for {len(items)} prompts')
        requests, groups = [], []  # groups: the choice indices of each prompt (one per sample of `n`)
        for prompt, config in zip(items, configs):
            prepared = self.async_engine.prepare(prompt, config, do_preprocess)
            choices = choice_requests(prepared, len(requests))
            groups.append([c.index for c in choices])
            requests += choices
        return single, requests, groups

    def __call__(self, prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                 do_preprocess: bool = True, use_tqdm: bool | None = None) -> Response | list[Response]:
        """Run prompts to completion. One prompt gives one `Response`, a list gives a list (in order); with
        `n > 1` each prompt gives a list of its `n` responses instead of one."""
        single, requests, groups = self._prepare_all(prompts, gen_config, do_preprocess)
        done: queue.Queue = queue.Queue()
        builders = {}
        for request in requests:
            builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
            builders[request.index] = builder
            self.async_engine.submit(request, lambda out, b=builder: done.put((b, out)))
        show = use_tqdm if use_tqdm is not None else len(requests) >= _TQDM_THRESHOLD
        remaining = len(requests)
        with tqdm(total=remaining, disable=not show, desc='generating') as bar:
            while remaining:
                builder, out = done.get()
                response = builder.update(out)
                if builder.take_abort():  # a stop string: the engine does not know
                    self.async_engine.abort(out.seq_id)
                if response is not None and builder.finished:
                    remaining -= 1
                    bar.update(1)
        responses = [builders[i].final() for i in range(len(requests))]
        per_prompt = [[responses[i] for i in group] if requests[group[0]].requested_n > 1 else responses[group[0]]
                      for group in groups]
        return per_prompt[0] if single else per_prompt

    def stream_infer(self, prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                     do_preprocess: bool = True) -> Iterator[Response]:
        """Incremental `Response`s of all prompts as they arrive (`Response.index` tells which prompt; with `n > 1`
        it is the choice: prompt i's samples are i*n .. i*n+n-1 when every prompt has the same n).

        Closing the iterator early aborts the requests that have not finished.
        """
        _, requests, _ = self._prepare_all(prompts, gen_config, do_preprocess)
        merged: queue.Queue = queue.Queue()
        unfinished: dict[int, int] = {}  # prompt index -> seq id
        for request in requests:
            builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
            unfinished[request.index] = self.async_engine.submit(
                request, lambda out, b=builder: merged.put((b, out)))
        try:
            while unfinished:
                builder, out = merged.get()
                response = builder.update(out)
                if builder.take_abort():  # a stop string: the engine does not know
                    self.async_engine.abort(out.seq_id)
                if response is None:
                    continue
                if builder.finished:
                    unfinished.pop(builder.index)
                yield response
        finally:
            for seq_id in unfinished.values():
                self.async_engine.abort(seq_id)

    @property
    def session_len(self) -> int:
        return self.engine.session_len

    def close(self) -> None:
        self.async_engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline(model_path: str, backend_config: PytorchEngineConfig | None = None,
             generation_config: str = 'auto', allowed_local_media_path: str | None = None) -> Pipeline:
    """Build a `Pipeline` over a Hugging Face checkpoint folder. Prompts may carry images (vision-language
    checkpoints): `(text, image)` / `(text, [images])` tuples, or chat messages with `image_url` / `image` parts."""
    return Pipeline(model_path, backend_config, generation_config, allowed_local_media_path)
