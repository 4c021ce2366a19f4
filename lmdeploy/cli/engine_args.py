"""Engine flags shared by `chat`, `serve api_server` and `demo`, named as LMDeploy names them."""
from __future__ import annotations

import argparse

from ..messages import PrefixCacheConfig, PytorchEngineConfig
from ..prefix_cache_config import CHECKPOINT_MODES
from ..speculative_config import MAX_DRAFT_TOKENS, SPECULATIVE_METHODS, SpeculativeConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('engine')
    group.add_argument('--backend', default='pytorch', choices=['pytorch'],
                       help="inference backend (LMDeploy's flag; this engine is the PyTorch one)")
    group.add_argument('--device', default=None, choices=['cuda', 'cpu'],
                       help='device type (default: cuda if available)')
    group.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    group.add_argument('--enable-prefix-caching', action='store_true', help='reuse cached prompt prefixes')
    group.add_argument('--cache-block-seq-len', type=int, default=64, help='tokens per KV block (block_size)')
    group.add_argument('--kernel-block-size', type=int, default=None, help='tokens per kernel page')
    group.add_argument('--cache-max-entry-count', type=float, default=0.8,
                       help='fraction of free memory given to the KV cache')
    group.add_argument('--num-gpu-blocks', type=int, default=0, help='fixed number of KV blocks (0: from memory)')
    group.add_argument('--max-batch-size', type=int, default=128)
    group.add_argument('--max-prefill-token-num', type=int, default=8192)
    group.add_argument('--session-len', type=int, default=None)
    add_prefix_cache_args(group)
    group.add_argument('--eager-mode', action='store_true', help='disable CUDA graphs')
    group.add_argument('--async-scheduling', action=argparse.BooleanOptionalAction, default=None,
                       help='overlap the host with the device: schedule step N+1 while step N runs (default: on '
                            'for CUDA where it applies)')
    group.add_argument('--enable-return-routed-experts', action='store_true',
                       help='MoE models: let requests ask for the experts each token was routed to')
    group.add_argument('--adapters', nargs='+', default=None, metavar='NAME=PATH',
                       help='LoRA adapters (PEFT folders) as name=path; a bare path is named "default"')
    group.add_argument('--max-loras', type=int, default=PytorchEngineConfig.max_loras,
                       help='most LoRA adapters loaded at once (all stay resident)')
    group.add_argument('--max-lora-rank', type=int, default=PytorchEngineConfig.max_lora_rank,
                       help='largest LoRA rank accepted; an adapter above it fails start-up')
    group.add_argument('--load-format', default='auto', choices=['auto', 'safetensors', 'dummy'],
                       help='dummy: random weights of the right shapes on the device, from config.json alone')
    group.add_argument('--revision', default=None,
                       help='a Hugging Face Hub model id: the branch, tag or commit to use (default: main)')
    group.add_argument('--download-dir', default=None,
                       help='a Hugging Face Hub model id: where to cache it (default: huggingface_hub cache)')
    group.add_argument('--tokenizer', default=None,
                       help="the tokenizer's folder or hub id, when not the model's (e.g. with --load-format dummy)")
    group.add_argument('--tp', type=int, default=1,
                       help='tensor parallelism: GPUs one model is split over (only 1 is supported yet)')
    group.add_argument('--speculative-algorithm', default=None, choices=list(SPECULATIVE_METHODS),
                       help="speculative decoding: 'mtp' drafts with the checkpoint's multi-token-prediction head")
    group.add_argument('--speculative-num-draft-tokens', type=int, default=1,
                       help=f'draft tokens per step, verified by one forward (1..{MAX_DRAFT_TOKENS}; needs '
                            '--speculative-algorithm)')
    group.add_argument('--vision-encoder-cache-mb', type=int, default=PytorchEngineConfig.vision_encoder_cache_mb,
                       help='vision-language models: MiB of encoded images kept by content hash (0: off)')


def add_prefix_cache_args(group) -> None:
    """One flag per `PrefixCacheConfig` field, `--prefix-cache-<field>` (booleans also as `--no-...`)."""
    d = PrefixCacheConfig()
    group.add_argument('--prefix-cache-state-budget', type=int, default=d.state_budget,
                       help='state rows reserved for prefix-cache checkpoints (hybrid models); > 0 overrides '
                       '--prefix-cache-state-ratio')
    group.add_argument('--prefix-cache-state-ratio', type=float, default=d.state_ratio,
                       help='hybrid models: share of the cache memory (see --cache-max-entry-count) given to '
                       'checkpoint state rows when the KV pool is sized from memory')
    group.add_argument('--prefix-cache-checkpoint-mode', default=d.checkpoint_mode, choices=list(CHECKPOINT_MODES),
                       help='hybrid models: state checkpoints at any safe step, or at block boundaries only')
    group.add_argument('--prefix-cache-decode-state-interval', type=int, default=d.decode_state_interval,
                       help='hybrid models: decode checkpoints every N tokens (a multiple of the block size; 0: off)')
    group.add_argument('--prefix-cache-prefill-state-interval', type=int, default=d.prefill_state_interval,
                       help='hybrid models: in-prefill checkpoints every N tokens (0: off)')
    group.add_argument('--prefix-cache-prefill-state-cap', type=int, default=d.prefill_state_cap,
                       help='hybrid models: at most this many in-prefill checkpoints per prompt')
    flags = (('reply_checkpoints', "checkpoint a finished request's prompt + reply"),
             ('prompt_logits', 'keep prompt-end logits so an identical prompt skips its prefill'),
             ('branch_checkpoints', 'end a chunk and checkpoint where a prompt diverges from cached ones'),
             ('value_eviction', 'evict checkpoints by compute saved per byte among the least recently used'))
    for name, text in flags:
        group.add_argument(f'--prefix-cache-{name.replace("_", "-")}', action=argparse.BooleanOptionalAction,
                           default=getattr(d, name), help=f'hybrid models: {text}')


def prefix_cache_config_from_args(args: argparse.Namespace) -> PrefixCacheConfig:
    return PrefixCacheConfig(**{name: getattr(args, f'prefix_cache_{name}') for name in PrefixCacheConfig().as_dict()})


def parse_adapters(specs: list[str] | None) -> dict[str, str] | None:
    """`['a=/p/a', '/p/b']` -> `{'a': '/p/a', 'default': '/p/b'}` (LMDeploy's `--adapters` syntax)."""
    if not specs:
        return None
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition('=')
        name, path = (name, path) if sep else ('default', spec)
        if not name or not path:
            raise ValueError(f'--adapters entry {spec!r} is not NAME=PATH or PATH')
        if name in adapters:
            raise ValueError(f'--adapters names {name!r} twice')
        adapters[name] = path
    return adapters


def engine_config_from_args(args: argparse.Namespace) -> PytorchEngineConfig:
    kwargs = dict(dtype=args.dtype, enable_prefix_caching=args.enable_prefix_caching,
                  block_size=args.cache_block_seq_len, kernel_block_size=args.kernel_block_size,
                  cache_max_entry_count=args.cache_max_entry_count, num_gpu_blocks=args.num_gpu_blocks,
                  max_batch_size=args.max_batch_size, max_prefill_token_num=args.max_prefill_token_num,
                  session_len=args.session_len, prefix_cache=prefix_cache_config_from_args(args),
                  eager_mode=args.eager_mode, async_scheduling=getattr(args, 'async_scheduling', None),
                  adapters=parse_adapters(getattr(args, 'adapters', None)),
                  max_loras=getattr(args, 'max_loras', PytorchEngineConfig.max_loras),
                  max_lora_rank=getattr(args, 'max_lora_rank', PytorchEngineConfig.max_lora_rank),
                  enable_return_routed_experts=getattr(args, 'enable_return_routed_experts', False),
                  load_format=getattr(args, 'load_format', 'auto'), revision=getattr(args, 'revision', None),
                  download_dir=getattr(args, 'download_dir', None), tokenizer=getattr(args, 'tokenizer', None),
                  tp=getattr(args, 'tp', 1),
                  vision_encoder_cache_mb=getattr(args, 'vision_encoder_cache_mb',
                                                  PytorchEngineConfig.vision_encoder_cache_mb),
                  speculative_config=speculative_config_from_args(args))
    if args.device is not None:
        kwargs['device_type'] = args.device
    return PytorchEngineConfig(**kwargs)


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    method = getattr(args, 'speculative_algorithm', None)
    num_tokens = getattr(args, 'speculative_num_draft_tokens', 1)
    if method is None:
        if num_tokens != 1:
            raise ValueError('--speculative-num-draft-tokens needs --speculative-algorithm')
        return None
    return SpeculativeConfig(method=method, num_speculative_tokens=num_tokens)


def resolve_model_path(model_path: str | None) -> str:
    if model_path:
        return model_path
    from ..demo_model import get_demo_model_path
    return get_demo_model_path(DEMO_ARCH)


DEMO_ARCH = 'qwen3_5'
