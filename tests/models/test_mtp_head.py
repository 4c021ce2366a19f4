"""The MTP head (`mtp.*`) loads into the model and its draft logits match a torch reference written from its
definition (`tests/mtp_reference.py`); the loader refuses models and checkpoints without a head."""
from __future__ import annotations

import shutil

import pytest
import torch
from mtp_reference import MTPReference, mtp_checkpoint_builder

from lmdeploy.pytorch.config import CacheConfig
from lmdeploy.pytorch.engine.cache_engine import CacheEngine
from lmdeploy.pytorch.model_inputs import ModelInputs, StepContext
from lmdeploy.pytorch.models.loader import build_model
from lmdeploy.pytorch.nn.moe import SparseMoeBlock

transformers = pytest.importorskip('transformers')

LIN, FULL = 'linear_attention', 'full_attention'
BLOCK = 16
CASES = {
    'qwen3_5': ('qwen3_5', dict(num_hidden_layers=2, layer_types=[LIN, FULL])),
    'qwen3_5_vl': ('qwen3_5_vl', dict(num_hidden_layers=2, layer_types=[FULL, LIN])),
    # MoE everywhere except layer 1: the MTP layer takes layer 0's kind of MLP (MoE)
    'qwen3_next': ('qwen3_next', dict(num_hidden_layers=2, layer_types=[LIN, FULL], mlp_only_layers=[1])),
}


@pytest.fixture(scope='module')
def mtp_checkpoints(tiny_model_factory, tmp_path_factory):
    return mtp_checkpoint_builder(tiny_model_factory, tmp_path_factory, CASES)


def _prefill_inputs(ids: torch.Tensor, positions: torch.Tensor) -> ModelInputs:
    n = len(ids)
    pages = -(-n // BLOCK)
    return ModelInputs(
        input_ids=ids, position_ids=positions, q_lens=torch.tensor([n]), kv_lens=torch.tensor([n]),
        cu_seqlens_q=torch.tensor([0, n]), block_tables=torch.arange(pages)[None],
        slot_mapping=torch.arange(n), logits_indices=torch.arange(n), state_ids=torch.tensor([1]),
        is_fresh=torch.tensor([True]), q_lens_list=[n], kv_lens_list=[n], max_seqlen_q=n, max_seqlen_k=n)


def _context(cache: CacheEngine, inputs: ModelInputs) -> StepContext:
    return StepContext(inputs=inputs, kv_caches=cache.kv_caches, state_caches=cache.state_caches,
                       kernel_block_size=BLOCK)


def _reference_pre_norm_hidden(path: str, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module]:
    cls = transformers.Qwen3_5ForConditionalGeneration if name == 'qwen3_5_vl' else transformers.AutoModelForCausalLM
    ref = cls.from_pretrained(path, dtype=torch.float32).eval()
    text = ref.model.language_model if name == 'qwen3_5_vl' else ref.model
    captured = {}

    def keep_input(module, args):
        captured['h'] = args[0][0].clone()  # returns None: the input is left as it is

    hook = text.norm.register_forward_pre_hook(keep_input)
    with torch.no_grad():
        ref(input_ids=ids[None])
    hook.remove()
    return captured['h'], ref


DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.gpu)]


def _head_outputs(path: str, name: str, device: str, ids: torch.Tensor | None = None):
    """The prompt (drawn when None), the target's pre-norm hidden states and the head's draft logits (row t: x_{t+1}
    and h_t at position t) on `device`, float32, on the host; and the cache engine the head's KV went into."""
    model, config = build_model(path, torch.device(device), 'float32', device, mtp=True)
    assert config.num_mtp_layers == 1 and model.mtp is not None
    assert isinstance(model.mtp.layers[0].mlp, SparseMoeBlock) == (name == 'qwen3_next')
    cache = CacheEngine(config, CacheConfig(block_size=BLOCK, kernel_block_size=BLOCK, num_blocks=4,
                                            num_state_slots=3), torch.device(device))
    assert len(cache.kv_caches) == config.num_attn_layers + 1
    if ids is None:
        ids = torch.randint(0, config.vocab_size, (21,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        inputs = _prefill_inputs(ids, torch.arange(len(ids))).to(device)
        normed, hidden = model.forward_with_hidden(_context(cache, inputs))
        draft_inputs = _prefill_inputs(ids[1:], torch.arange(len(ids) - 1)).to(device)
        got = model.compute_logits(model.draft_hidden(hidden[:-1], _context(cache, draft_inputs))).cpu()
    return ids, hidden.cpu(), got, cache


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('name', list(CASES))
def test_mtp_head_logits_match_torch_reference(mtp_checkpoints, name, device):
    """float32 on the default backend (CPU) against the torch reference, and on the cuda backend (GPU) against the
    default backend: with fla-core installed (the GPU machine) transformers binds fla's kernels, which fail on CPU
    tensors, so transformers cannot be the reference there; the CPU case ties the default backend to it."""
    path = mtp_checkpoints(name)
    ids, hidden, got, cache = _head_outputs(path, name, device)
    if device == 'cpu':
        want_hidden, ref = _reference_pre_norm_hidden(path, name, ids)
        embed = ref.get_input_embeddings().weight
        want = MTPReference(path).logits(want_hidden[:-1], ids[1:], torch.arange(len(ids) - 1), embed,
                                         ref.get_output_embeddings().weight)
        tol = 1e-4
    else:
        _, want_hidden, want, _ = _head_outputs(path, name, 'cpu', ids)
        tol = 2e-3  # cuda: TF32 matmuls may be on
    torch.testing.assert_close(hidden, want_hidden, atol=tol, rtol=tol)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the head's KV went into its own pool layer (the last one), not over the target's
    k_mtp = cache.kv_caches[-1][0].reshape(-1, *cache.kv_caches[-1][0].shape[2:])[:len(ids) - 1]
    assert k_mtp.abs().sum() > 0


def test_mtp_weights_are_skipped_without_speculation(mtp_checkpoints):
    model, config = build_model(mtp_checkpoints('qwen3_5'), torch.device('cpu'), 'float32', 'cpu')
    assert model.mtp is None and config.num_mtp_layers == 0


def test_mtp_refuses_config_without_head(tiny_model_factory):
    path = tiny_model_factory('qwen3_5', num_hidden_layers=2, layer_types=[LIN, FULL])
    with pytest.raises(ValueError, match='declares no MTP head'):
        build_model(path, torch.device('cpu'), 'float32', 'cpu', mtp=True)


def test_mtp_refuses_checkpoint_without_mtp_weights(mtp_checkpoints, tmp_path):
    path = shutil.copytree(mtp_checkpoints('qwen3_5'), tmp_path / 'stripped', dirs_exist_ok=True)
    (path / 'mtp.safetensors').unlink()
    with pytest.raises(ValueError, match='has no mtp.\\* weights'):
        build_model(str(path), torch.device('cpu'), 'float32', 'cpu', mtp=True)


def test_mtp_refuses_model_without_head_support(tiny_model_factory):
    with pytest.raises(ValueError, match='needs a model with an MTP head'):
        build_model(tiny_model_factory('qwen3'), torch.device('cpu'), 'float32', 'cpu', mtp=True)


def _engine(path: str):
    from lmdeploy import PytorchEngineConfig, SpeculativeConfig
    from lmdeploy.pytorch.engine.engine import Engine
    return Engine(path, PytorchEngineConfig(device_type='cpu', block_size=BLOCK, num_gpu_blocks=8,
                                            speculative_config=SpeculativeConfig('mtp', 2)))


def test_engine_refuses_speculation_on_a_model_without_mtp_head(tiny_model_factory):
    with pytest.raises(ValueError, match='declares no MTP head'):
        _engine(tiny_model_factory('qwen3_5', num_hidden_layers=2, layer_types=[LIN, FULL]))


def test_engine_with_speculation_sizes_k_spare_state_rows_per_sequence(mtp_checkpoints):
    """(Decoding with the head is tested in tests/engine/test_mtp_engine.py.) The state pool holds the dummy row, a
    spare, and per batch slot its runtime row plus K = 2 draft rows; each row ends with the head's hidden entry."""
    engine = _engine(mtp_checkpoints('qwen3_5'))
    batch = engine.engine_config.max_batch_size
    assert engine.cache_config.num_state_slots == 1 + batch * 3 + 1
    assert engine.cache_engine.mtp_hidden.shape == (engine.cache_config.num_state_slots,
                                                    engine.model_config.hidden_size)


def test_block_copies_cover_the_mtp_head_kv(mtp_checkpoints):
    """A logical block copy (a prefix-cache restore of a frozen partial block, a save) moves the head's KV too."""
    _, config = build_model(mtp_checkpoints('qwen3_5'), torch.device('cpu'), 'float32', 'cpu', mtp=True)
    cache = CacheEngine(config, CacheConfig(block_size=BLOCK, kernel_block_size=BLOCK // 2, num_blocks=4,
                                            num_state_slots=2), torch.device('cpu'))
    assert cache.kv_pool.shape[0] == config.num_attn_layers + config.num_mtp_layers
    cache.kv_pool.copy_(torch.randint(0, 255, cache.kv_pool.shape, dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(0)))
    head_k = cache.kv_caches[-1][0]  # [pages, kbs, heads, dim]; block b = pages 2b, 2b + 1
    before = head_k[2:4].clone()
    cache.copy_logical_blocks(torch.tensor([[1], [3]]))
    assert torch.equal(head_k[6:8].view(torch.uint8), before.view(torch.uint8))  # bytes: random bits hold NaNs
    assert not torch.equal(head_k[2:4].view(torch.uint8), head_k[4:6].view(torch.uint8))
