"""User-facing records: engine config, generation config and responses.

These are the only types a `pipeline` user has to know. Configs are frozen and validated on construction so a bad
value fails before any model is loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .prefix_cache_config import FLAT_NAMES, PrefixCacheConfig
from .speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import numpy as np

_DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
_DEVICES = ('cuda', 'cpu')
_LOAD_FORMATS = ('auto', 'safetensors', 'dummy')
MAX_N = 128  # samples per prompt
FinishReason = Literal['stop', 'length', 'abort', 'error']


def _default_device() -> str:
    try:
        import torch
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return 'cpu'


class UnknownAdapterError(ValueError):
    """A request named a LoRA adapter the engine has not loaded (the server answers 404)."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class PytorchEngineConfig:
    """Configuration of the PyTorch engine.

    Memory: the KV pool is sized from `num_gpu_blocks` when it is positive, otherwise from
    `cache_max_entry_count` times the device memory left after weights and the state pool (on CPU a fixed budget).
    """
    device_type: str = field(default_factory=_default_device)
    dtype: str = 'auto'
    block_size: int = 64
    kernel_block_size: int | None = None
    cache_max_entry_count: float = 0.8
    num_gpu_blocks: int = 0
    max_batch_size: int = 128
    max_prefill_token_num: int = 8192
    session_len: int | None = None
    enable_prefix_caching: bool = False
    # CUDA: run decode eagerly instead of replaying CUDA graphs captured at start-up (one per padded batch size).
    eager_mode: bool = False
    # Recurrent (hybrid) models: dtype of the recurrent state; 'float32' (default) or 'model'.
    state_dtype: str = 'float32'
    # Every prefix-cache knob (`PrefixCacheConfig`, lmdeploy/prefix_cache_config.py). Not given: built from the flat
    # `prefix_cache_*` fields below, which stay accepted (each is the `PrefixCacheConfig` field of the same name
    # without the prefix; `prefix_cache_state_budget` -> `state_budget`). Given: it wins, the flat fields are set
    # from it, and a flat field given with another value is a `ValueError`.
    prefix_cache: PrefixCacheConfig | None = None
    prefix_cache_state_budget: int = 0
    prefix_cache_state_ratio: float = 0.2
    prefix_cache_checkpoint_mode: str = 'exact'
    prefix_cache_decode_state_interval: int = 0
    prefix_cache_reply_checkpoints: bool = True
    prefix_cache_prompt_logits: bool = True
    prefix_cache_branch_checkpoints: bool = True
    prefix_cache_value_eviction: bool = True
    prefix_cache_prefill_state_interval: int = 16384
    prefix_cache_prefill_state_cap: int = 2
    # Vision-language models: MiB of device memory for encoded images kept by content hash (0 = off), so an image
    # seen again outside a prefix-cache hit skips the vision tower.
    vision_encoder_cache_mb: int = 256
    # LoRA adapters: name -> PEFT folder (`adapter_config.json` + `adapter_model.safetensors`). All stay resident;
    # a request picks one by `GenerationConfig.adapter_name` (None: the base model).
    adapters: dict[str, str] | None = None
    # At most this many adapters, each of rank at most `max_lora_rank` (checked at start-up).
    max_loras: int = 8
    max_lora_rank: int = 64
    # Let requests ask for the experts each MoE layer routed every token to (`GenerationConfig.
    # return_routed_experts`); MoE layers then record them and, with prefix caching, cached blocks and checkpoints
    # keep them (`engine.stats['routed_experts_bytes_per_token']` says what a cached token costs).
    enable_return_routed_experts: bool = False
    # Weights: 'auto' / 'safetensors' read the checkpoint; 'dummy' (vLLM's name) draws random weights of the right
    # shapes and dtypes on the device, from config.json alone (benchmarks at full size; pair with `tokenizer`).
    load_format: str = 'auto'
    # A Hugging Face Hub model id resolves to this revision (branch, tag or commit), cached in `download_dir`
    # (default: huggingface_hub's cache, HF_HOME / HF_HUB_CACHE); HF_HUB_OFFLINE=1 reads the cache only.
    revision: str | None = None
    download_dir: str | None = None
    # The tokenizer's folder or hub id, when not the model's (e.g. a config-only folder with load_format='dummy').
    tokenizer: str | None = None
    # Tensor parallelism (LMDeploy's `--tp`): ranks one model is split over, one process per GPU. The model's head
    # counts are checked at engine start (`models/tp_geometry.py`); the multi-rank runtime is not built yet, so any
    # value above 1 is refused there.
    tp: int = 1
    # Speculative decoding (`SpeculativeConfig`, lmdeploy/speculative_config.py); None: off.
    speculative_config: SpeculativeConfig | None = None
    # Overlap the host with the device (vLLM's `async_scheduling`): step N+1 is scheduled and launched before step
    # N's sampled tokens reach the host, which feed it on the device (`engine/async_scheduling.py`). None: on for CUDA
    # wherever it applies (tp 1, no speculative decoding, no decode-interval checkpoints), off on CPU.
    async_scheduling: bool | None = None

    def __post_init__(self):
        _require(self.device_type in _DEVICES, f'device_type must be one of {_DEVICES}, got {self.device_type!r}')
        _require(self.dtype in _DTYPES, f'dtype must be one of {_DTYPES}, got {self.dtype!r}')
        _require(isinstance(self.block_size, int) and self.block_size > 0,
                 f'block_size must be a positive int, got {self.block_size!r}')
        kbs = self.block_size if self.kernel_block_size is None else self.kernel_block_size
        _require(isinstance(kbs, int) and kbs > 0 and (kbs & (kbs - 1)) == 0,
                 f'kernel_block_size must be a positive power of two, got {kbs!r}')
        _require(self.block_size % kbs == 0,
                 f'kernel_block_size ({kbs}) must divide block_size ({self.block_size})')
        _require(0.0 < self.cache_max_entry_count <= 1.0,
                 f'cache_max_entry_count must be in (0, 1], got {self.cache_max_entry_count!r}')
        _require(isinstance(self.num_gpu_blocks, int) and self.num_gpu_blocks >= 0,
                 f'num_gpu_blocks must be >= 0, got {self.num_gpu_blocks!r}')
        _require(isinstance(self.max_batch_size, int) and self.max_batch_size > 0,
                 f'max_batch_size must be a positive int, got {self.max_batch_size!r}')
        _require(isinstance(self.max_prefill_token_num, int) and self.max_prefill_token_num > 0,
                 f'max_prefill_token_num must be a positive int, got {self.max_prefill_token_num!r}')
        _require(self.session_len is None or (isinstance(self.session_len, int) and self.session_len > 0),
                 f'session_len must be None or a positive int, got {self.session_len!r}')
        _require(self.state_dtype in ('float32', 'model'),
                 f"state_dtype must be 'float32' or 'model', got {self.state_dtype!r}")
        _require(isinstance(self.prefix_cache_state_budget, int) and self.prefix_cache_state_budget >= 0,
                 f'prefix_cache_state_budget must be >= 0, got {self.prefix_cache_state_budget!r}')
        _require(isinstance(self.prefix_cache_state_ratio, int | float) and 0 <= self.prefix_cache_state_ratio < 1,
                 f'prefix_cache_state_ratio must be in [0, 1), got {self.prefix_cache_state_ratio!r}')
        _require(self.prefix_cache_checkpoint_mode in ('exact', 'aligned'),
                 "prefix_cache_checkpoint_mode must be 'exact' or 'aligned', "
                 f'got {self.prefix_cache_checkpoint_mode!r}')
        interval = self.prefix_cache_decode_state_interval
        _require(isinstance(interval, int) and interval >= 0 and interval % self.block_size == 0,
                 f'prefix_cache_decode_state_interval must be a non-negative multiple of block_size '
                 f'({self.block_size}), got {interval!r}')
        interval = self.prefix_cache_prefill_state_interval
        _require(isinstance(interval, int) and interval >= 0,
                 f'prefix_cache_prefill_state_interval must be a non-negative int, got {interval!r}')
        _require(isinstance(self.prefix_cache_prefill_state_cap, int) and self.prefix_cache_prefill_state_cap >= 0,
                 f'prefix_cache_prefill_state_cap must be >= 0, got {self.prefix_cache_prefill_state_cap!r}')
        self._resolve_prefix_cache()
        _require(isinstance(self.vision_encoder_cache_mb, int) and self.vision_encoder_cache_mb >= 0,
                 f'vision_encoder_cache_mb must be >= 0, got {self.vision_encoder_cache_mb!r}')
        _require(self.adapters is None or (isinstance(self.adapters, dict) and all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.adapters.items())),
                 f'adapters must map non-empty names to PEFT folder paths, got {self.adapters!r}')
        _require(isinstance(self.max_loras, int) and self.max_loras > 0,
                 f'max_loras must be a positive int, got {self.max_loras!r}')
        _require(isinstance(self.max_lora_rank, int) and self.max_lora_rank > 0,
                 f'max_lora_rank must be a positive int, got {self.max_lora_rank!r}')
        _require(len(self.adapters or {}) <= self.max_loras,
                 f'{len(self.adapters or {})} adapters given but max_loras is {self.max_loras}')
        _require(isinstance(self.tp, int) and not isinstance(self.tp, bool) and self.tp >= 1,
                 f'tp must be a positive int, got {self.tp!r}')
        _require(self.load_format in _LOAD_FORMATS,
                 f'load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}')
        _require(self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig),
                 f'speculative_config must be a SpeculativeConfig or None, got {self.speculative_config!r}')
        _require(self.async_scheduling in (None, True, False),
                 f'async_scheduling must be True, False or None, got {self.async_scheduling!r}')
        _require(not self.async_scheduling or (self.tp == 1 and self.speculative_config is None
                                               and not self.prefix_cache_decode_state_interval),
                 'async_scheduling=True needs tp=1, no speculative decoding and '
                 'prefix_cache_decode_state_interval=0 (those steps need the sampled tokens on the host)')

    def _resolve_prefix_cache(self) -> None:
        """One source of truth for the prefix-cache knobs: `prefix_cache`, kept equal to the flat fields."""
        flat = {name: getattr(self, flat_name) for flat_name, name in FLAT_NAMES.items()}
        if self.prefix_cache is None:
            object.__setattr__(self, 'prefix_cache', PrefixCacheConfig(**flat))
        else:
            _require(isinstance(self.prefix_cache, PrefixCacheConfig),
                     f'prefix_cache must be a PrefixCacheConfig, got {self.prefix_cache!r}')
            defaults = PrefixCacheConfig()
            clash = sorted(f'prefix_cache_{name}' for name, value in flat.items()
                           if value != getattr(defaults, name) and value != getattr(self.prefix_cache, name))
            _require(not clash, f'{", ".join(clash)} disagree with prefix_cache; give one or the other')
            for flat_name, name in FLAT_NAMES.items():
                object.__setattr__(self, flat_name, getattr(self.prefix_cache, name))
        self.prefix_cache.resolved(self.block_size)  # the decode interval must be a multiple of block_size

    @property
    def resolved_kernel_block_size(self) -> int:
        return self.block_size if self.kernel_block_size is None else self.kernel_block_size


STRUCTURED_KINDS = ('json_object', 'json_schema', 'regex', 'grammar')


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token while sampling.

    `kind`: 'json_object' (any JSON object; `spec` unused), 'json_schema' (`spec`: the schema as JSON text),
    'regex' (`spec`: a regular expression the whole reply must match) or 'grammar' (`spec`: an EBNF grammar in
    xgrammar's GBNF dialect, rule `root`).
    """
    kind: str
    spec: str | None = None


@dataclass
class GenerationConfig:
    """Sampling and stopping parameters of one request."""
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    random_seed: int | None = None
    # Number of top log-probabilities to return per generated token (None: none).
    logprobs: int | None = None
    # LoRA adapter to run the request with (a name of `PytorchEngineConfig.adapters`); None: the base model.
    adapter_name: str | None = None
    # Independent samples per prompt (`pipe` then returns a list of `n` responses per prompt); with a seed,
    # sample i uses seed + i.
    n: int = 1
    # OpenAI penalties over the generated tokens, each in [-2, 2]: logit -= frequency * count + presence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Keep only tokens with probability >= min_p times the most likely token's (after temperature); 0 = off.
    min_p: float = 0.0
    # token id -> bias in [-100, 100] added to its logit.
    logit_bias: dict[int, float] | None = None
    # Return `Response.routed_experts` with the final response (the engine needs enable_return_routed_experts).
    return_routed_experts: bool = False
    # Constrain the reply to JSON, a JSON schema, a regex or a grammar (None: free text).
    structured_output: StructuredOutput | None = None

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field: its type first (`True` is not an int, `1` is not a
        bool; floats are finite), then its range. Every field has a check (`GENERATION_CHECKS`)."""
        for name, check in GENERATION_CHECKS.items():
            problem = check(getattr(self, name))
            if problem is not None:
                raise ValueError(f'{name} must be {problem}, got {getattr(self, name)!r}')


# ---- field checks: each returns None when the value is fine, else what the value must be ---------------------------
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return (isinstance(value, float) or _is_int(value)) and math.isfinite(value)


def _int(low: int | None = None, high: int | None = None, optional: bool = False, text: str | None = None):
    what = ('None or ' if optional else '') + 'an int' + (text or _range_text(low, high))

    def check(value):
        if optional and value is None:
            return None
        ok = _is_int(value) and (low is None or value >= low) and (high is None or value <= high)
        return None if ok else what
    return check


def _real(what: str, ok):
    def check(value):
        return None if _is_real(value) and ok(value) else f'a finite number {what}'
    return check


def _bool(value):
    return None if isinstance(value, bool) else 'a bool'


def _list_of(item_ok, what: str):
    def check(value):
        if value is None:
            return None
        ok = isinstance(value, list | tuple) and all(item_ok(item) for item in value)
        return None if ok else f'None or a list of {what}'
    return check


def _optional_name(value):
    return None if value is None or (isinstance(value, str) and value) else 'None or a non-empty string'


def _logit_bias(value):
    ok = value is None or (isinstance(value, dict) and all(
        _is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100 for t, b in value.items()))
    return None if ok else 'None or a dict of token ids to finite numbers in [-100, 100]'


def _structured_output(value):
    if value is None:
        return None
    ok = isinstance(value, StructuredOutput) and value.kind in STRUCTURED_KINDS and (
        value.kind == 'json_object' or (isinstance(value.spec, str) and value.spec != ''))
    return None if ok else f'None or a StructuredOutput of kind {STRUCTURED_KINDS} with a non-empty spec'


def _range_text(low, high) -> str:
    if low is not None and high is not None:
        return f' in [{low}, {high}]'
    return f' >= {low}' if low is not None else ''


GENERATION_CHECKS = {
    'max_new_tokens': _int(0),
    'min_new_tokens': _int(0),
    'do_sample': _bool,
    'temperature': _real('>= 0', lambda v: v >= 0),
    'top_p': _real('in (0, 1]', lambda v: 0 < v <= 1),
    'top_k': _int(0),
    'repetition_penalty': _real('> 0', lambda v: v > 0),
    'stop_words': _list_of(lambda w: isinstance(w, str) and w != '', 'non-empty strings'),
    'stop_token_ids': _list_of(lambda t: _is_int(t) and t >= 0, 'non-negative ints'),
    'ignore_eos': _bool,
    'random_seed': _int(-2**63, 2**64 - 1, optional=True, text=' in [-2**63, 2**64)'),
    'logprobs': _int(0, 64, optional=True),
    'adapter_name': _optional_name,
    'return_routed_experts': _bool,
    'n': _int(1, MAX_N),
    'presence_penalty': _real('in [-2, 2]', lambda v: -2 <= v <= 2),
    'frequency_penalty': _real('in [-2, 2]', lambda v: -2 <= v <= 2),
    'min_p': _real('in [0, 1]', lambda v: 0 <= v <= 1),
    'logit_bias': _logit_bias,
    'structured_output': _structured_output,
}


@dataclass
class Response:
    """The result (or, when streaming, the state so far) of one request."""
    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: FinishReason | None = None
    token_ids: list[int] = field(default_factory=list)
    # Prompt tokens served from the prefix cache.
    cached_tokens: int = 0
    # One dict per generated token: {token_id: logprob} of the top-k tokens (the sampled one included).
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    error: str | None = None
    # Final response of a request that asked (`return_routed_experts`): uint16 [num_prompt + num_generated - 1,
    # num_moe_layers, top_k], the experts each MoE layer (in layer order) routed every fed position to, for prompt
    # and reply alike, cached positions included. Dense models have no MoE layer: [n - 1, 0, 0].
    routed_experts: np.ndarray | None = None
