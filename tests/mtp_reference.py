"""Random `mtp.*` weights for tiny checkpoints, and a torch reference of the MTP head written from its definition.

transformers ignores `mtp.*` on load and has no MTP module, so the reference is assembled here: zero-centred RMSNorm
and the `fc` projection in plain torch, and the head's decoder layer as transformers' own full-attention decoder
layer of the same model family (q/k norm, output gate, partial rotary, MLP or MoE), fed the weights we wrote.

    h' = fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)]);  h' = layer(h', positions t);  logits = lm_head(norm(h'))
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable

import torch
import transformers
from safetensors.torch import save_file

MTP_FILE = 'mtp.safetensors'
_INDEX_FILE = 'model.safetensors.index.json'
# text model_type -> (decoder layer class, rotary class, config key of the MTP layer count)
_FAMILIES = {
    'qwen3_5_text': ('qwen3_5', 'Qwen3_5DecoderLayer', 'Qwen3_5TextRotaryEmbedding', 'mtp_num_hidden_layers'),
    'qwen3_5_moe_text': ('qwen3_5_moe', 'Qwen3_5MoeDecoderLayer', 'Qwen3_5MoeTextRotaryEmbedding',
                         'mtp_num_hidden_layers'),
    'qwen3_next': ('qwen3_next', 'Qwen3NextDecoderLayer', 'Qwen3NextRotaryEmbedding', 'num_nextn_predict_layers'),
}


def _text_config(path: str):
    config = transformers.AutoConfig.from_pretrained(path)
    return getattr(config, 'text_config', None) or config


def _family(text_config):
    module_name, layer_cls, rotary_cls, key = _FAMILIES[text_config.model_type]
    module = getattr(transformers.models, module_name)
    modeling = getattr(module, f'modeling_{module_name}')
    return getattr(modeling, layer_cls), getattr(modeling, rotary_cls), key


def _layer_config(text_config):
    """The text config with layer 0 full attention, so transformers builds layer 0 as the MTP layer (its MLP kind
    is layer 0's, as the engine's)."""
    cfg = copy.deepcopy(text_config)
    cfg.layer_types = ['full_attention'] + list(cfg.layer_types[1:])
    cfg._attn_implementation = 'eager'
    return cfg


def _randomize_(module: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for param in module.parameters():
            fan_in = param.shape[-1] if param.ndim > 1 else 1
            scale = 0.2 if param.ndim == 1 else fan_in ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


def add_random_mtp_weights(path: str, seed: int = 0) -> str:
    """Write random `mtp.*` weights (one MTP layer) beside the checkpoint in `path` and declare the head in
    config.json; returns `path`. Edit a private copy: the tiny-model factory's folders are shared."""
    text_config = _text_config(path)
    layer_cls, _, key = _family(text_config)
    generator = torch.Generator().manual_seed(seed)
    layer = layer_cls(_layer_config(text_config), 0)
    _randomize_(layer, generator)
    hidden = text_config.hidden_size
    tensors = {f'mtp.layers.0.{name}': t.detach().clone().contiguous() for name, t in layer.state_dict().items()}
    tensors['mtp.fc.weight'] = torch.randn(hidden, 2 * hidden, generator=generator) * (2 * hidden) ** -0.5
    for norm in ('pre_fc_norm_embedding', 'pre_fc_norm_hidden', 'norm'):
        tensors[f'mtp.{norm}.weight'] = torch.randn(hidden, generator=generator) * 0.2
    save_file(tensors, os.path.join(path, MTP_FILE))
    index = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            data = json.load(f)
        data['weight_map'].update({name: MTP_FILE for name in tensors})
        with open(index, 'w') as f:
            json.dump(data, f)
    config_file = os.path.join(path, 'config.json')
    with open(config_file) as f:
        config = json.load(f)
    (config.get('text_config') or config)[key] = 1
    with open(config_file, 'w') as f:
        json.dump(config, f)
    return path


def mtp_checkpoint_builder(tiny_model_factory, tmp_path_factory, cases: dict[str, tuple[str, dict]],
                           default: str | None = None) -> Callable[..., str]:
    """`get(name=default)`: a copy of the tiny checkpoint `cases[name] = (arch, overrides)` with random `mtp.*`
    weights (seed 1), built once per name (for a module-scoped fixture)."""
    built: dict[str, str] = {}

    def get(name: str | None = default) -> str:
        if name not in built:
            arch, overrides = cases[name]
            path = shutil.copytree(tiny_model_factory(arch, **overrides), tmp_path_factory.mktemp(f'{name}-mtp'),
                                   dirs_exist_ok=True)
            built[name] = add_random_mtp_weights(str(path), seed=1)
        return built[name]
    return get


def _zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


class MTPReference:
    """The head of the checkpoint in `path` (after `add_random_mtp_weights`), in float32 on the CPU."""

    def __init__(self, path: str):
        from safetensors.torch import load_file
        text_config = _text_config(path)
        layer_cls, rotary_cls, _ = _family(text_config)
        weights = load_file(os.path.join(path, MTP_FILE))
        cfg = _layer_config(text_config)
        self.eps = cfg.rms_norm_eps
        self.layer = layer_cls(cfg, 0).float().eval()
        prefix = 'mtp.layers.0.'
        self.layer.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
        self.rotary = rotary_cls(cfg)
        self.weights = weights

    @torch.no_grad()
    def logits(self, prev_hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
               embed: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, V] of one sequence: row t reads the target's pre-norm hidden `prev_hidden[t]` and the
        token `next_ids[t]` (x_{t+1}) at `positions[t]`, attending causally over rows 0..t."""
        w = self.weights
        e = _zero_centred_rms_norm(embed[next_ids], w['mtp.pre_fc_norm_embedding.weight'], self.eps)
        h = _zero_centred_rms_norm(prev_hidden, w['mtp.pre_fc_norm_hidden.weight'], self.eps)
        x = torch.cat([e, h], dim=-1) @ w['mtp.fc.weight'].T
        T = x.shape[0]
        mask = torch.full((T, T), float('-inf')).triu(1)[None, None]
        cos_sin = self.rotary(x[None], positions[None])
        x = self.layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions[None])
        x = x[0] if isinstance(x, torch.Tensor) else x[0][0]
        x = _zero_centred_rms_norm(x, w['mtp.norm.weight'], self.eps)
        return x @ lm_head.T
