"""lmdeploy: an inference and serving engine for hybrid LLMs with exact-step prefix caching."""
from .messages import GenerationConfig, PrefixCacheConfig, PytorchEngineConfig, Response, StructuredOutput
from .speculative_config import SpeculativeConfig
from .version import __version__


def pipeline(model_path: str, backend_config: PytorchEngineConfig | None = None,
             allowed_local_media_path: str | None = None, generation_config: str = 'auto'):
    """Build a `Pipeline` over a Hugging Face checkpoint folder (see `lmdeploy.serve.pipeline`);
    `allowed_local_media_path`: the folder images may be read from by path (None: no local image files);
    `generation_config='none'` ignores the model's generation_config.json sampling defaults."""
    from .serve.pipeline import Pipeline
    return Pipeline(model_path, backend_config, allowed_local_media_path=allowed_local_media_path,
                    generation_config=generation_config)


__all__ = ['GenerationConfig', 'PrefixCacheConfig', 'PytorchEngineConfig', 'Response', 'SpeculativeConfig',
           'StructuredOutput', 'pipeline', '__version__']
