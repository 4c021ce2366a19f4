"""`Pipeline`: batch and streaming inference for Python users."""
from __future__ import annotations

import queue
from collections.abc import Iterator

from tqdm import tqdm

from ..messages import GenerationConfig, PytorchEngineConfig, Response
from .async_engine import AsyncEngine
from .request_builder import ResponseBuilder, is_single_prompt
from .vision.images import ImageLoadConfig

_TQDM_THRESHOLD = 16


class Pipeline:

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | None = None,
                 allowed_local_media_path: str | None = None):
        """`allowed_local_media_path`: the folder images may be read from by path or file:// URL (None: no local
        files; PIL images, data URLs and http(s) URLs are always accepted)."""
        self.async_engine = AsyncEngine(model_path, backend_config,
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
        requests = [self.async_engine.prepare(p, c, do_preprocess, index=i)
                    for i, (p, c) in enumerate(zip(items, configs))]
        return single, requests

    def __call__(self, prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                 do_preprocess: bool = True, use_tqdm: bool | None = None) -> Response | list[Response]:
        """Run prompts to completion. One prompt gives one `Response`, a list gives a list (in order)."""
        single, requests = self._prepare_all(prompts, gen_config, do_preprocess)
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
                builder.update(out)
                if out.finished:
                    remaining -= 1
                    bar.update(1)
        responses = [builders[i].final() for i in range(len(requests))]
        return responses[0] if single else responses

    def stream_infer(self, prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                     do_preprocess: bool = True) -> Iterator[Response]:
        """Incremental `Response`s of all prompts as they arrive (`Response.index` tells which prompt).

        Closing the iterator early aborts the requests that have not finished.
        """
        _, requests = self._prepare_all(prompts, gen_config, do_preprocess)
        merged: queue.Queue = queue.Queue()
        unfinished: dict[int, int] = {}  # prompt index -> seq id
        for request in requests:
            builder = ResponseBuilder(self.tokenizer, len(request.input_ids), request.gen_config, request.index)
            unfinished[request.index] = self.async_engine.submit(
                request, lambda out, b=builder: merged.put((b, out)))
        try:
            while unfinished:
                builder, out = merged.get()
                if out.finished:
                    del unfinished[builder.index]
                yield builder.update(out)
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
             allowed_local_media_path: str | None = None) -> Pipeline:
    """Build a `Pipeline` over a Hugging Face checkpoint folder. Prompts may carry images (vision-language
    checkpoints): `(text, image)` / `(text, [images])` tuples, or chat messages with `image_url` / `image` parts."""
    return Pipeline(model_path, backend_config, allowed_local_media_path)
