"""lmdeploy: an inference and serving engine for hybrid LLMs with exact-step prefix caching."""
from .messages import GenerationConfig, PrefixCacheConfig, PytorchEngineConfig, Response
from .version import __version__


def pipeline(model_path: str, backend_config: PytorchEngineConfig | None = None):
    """Build a `Pipeline` over a Hugging Face checkpoint folder (see `lmdeploy.serve.pipeline`)."""
    from .serve.pipeline import Pipeline
    return Pipeline(model_path, backend_config)


__all__ = ['GenerationConfig', 'PrefixCacheConfig', 'PytorchEngineConfig', 'Response', 'pipeline', '__version__']
