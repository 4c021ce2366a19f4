"""The fused MoE's tuned tile tables (`kernels/cuda/moe.py`): file lookup, the nearest entry by pair count, the
start-up warm-up's token counts, and a clear error for a malformed table. Pure host logic (no kernel runs); the
kernels with a non-default config are checked against the torch reference in `test_cuda_kernels_ops.py`."""
from __future__ import annotations

import json
import os

import pytest
import torch

from lmdeploy.pytorch.kernels.cuda import moe, moe_align
from lmdeploy.pytorch.kernels.cuda.launch import arg_key

SHAPE = dict(num_experts=64, hidden=2048, inter=512)
DEVICE = 'Test GPU 9000'
ENTRIES = {'8': [16, [64, 128, 4, 3], [64, 64, 8, 4]], '1024': [16, [32, 128, 4, 4], [64, 64, 4, 3]],
           '8192': [128, [128, 64, 8, 3], [64, 64, 4, 3]]}


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setenv('LMDEPLOY_MOE_CONFIG_DIR', str(tmp_path))
    moe._table.cache_clear()
    moe._call_config.cache_clear()
    yield tmp_path
    moe._table.cache_clear()
    moe._call_config.cache_clear()


def write(folder, entries, name=DEVICE) -> str:
    path = os.path.join(folder, moe.config_file_name(SHAPE['num_experts'], SHAPE['hidden'], SHAPE['inter'], name))
    with open(path, 'w') as f:
        json.dump({'configs': entries}, f)
    return path


def config_of(entry) -> moe.MoeConfig:
    bm, up, down = entry
    return moe.MoeConfig(bm, tuple(up), tuple(down))


def test_file_name_names_shape_and_device():
    assert moe.config_file_name(64, 2048, 512, 'NVIDIA H200') == 'E=64,H=2048,I=512,device=NVIDIA_H200.json'


def test_nearest_entry_by_ratio(table_dir):
    write(table_dir, ENTRIES)
    pick = lambda pairs: moe.default_config(pairs, device_name=DEVICE, **SHAPE)  # noqa: E731
    assert pick(8) == config_of(ENTRIES['8'])
    assert pick(1) == config_of(ENTRIES['8'])                  # below the table: its first entry
    assert pick(90) == config_of(ENTRIES['8'])                 # 90/8 = 11.3 < 1024/90 = 11.4
    assert pick(91) == config_of(ENTRIES['1024'])
    assert pick(2890) == config_of(ENTRIES['1024'])            # sqrt(1024 * 8192) = 2896
    assert pick(2900) == config_of(ENTRIES['8192'])
    assert pick(10 ** 6) == config_of(ENTRIES['8192'])


def test_no_table_means_untuned_tiles(table_dir):
    write(table_dir, ENTRIES)
    untuned = moe.default_config(8, SHAPE['num_experts'])
    assert untuned == moe.MoeConfig(16, (64, 64, 4, 3), (64, 64, 4, 3))
    assert moe.default_config(8, device_name='Other GPU', **SHAPE) == untuned        # another device
    assert moe.default_config(8, 32, 2048, 512, DEVICE) == moe.default_config(8, 32)  # another shape
    assert moe.default_config(8, device_name=None, **SHAPE) == untuned               # CPU
    assert moe.default_config(64 * 100, SHAPE['num_experts']).block_m == 64          # 100 rows per expert
    # from 256 rows an expert (a long prefill, or a released expert count without a table) the tables' large tiles
    assert moe.default_config(256 * 255, 256) != moe.LARGE_ROWS_CONFIG
    assert moe.default_config(256 * 256, 256) == moe.default_config(10 ** 6, 512) == moe.LARGE_ROWS_CONFIG
    assert moe.default_config(256 * 64, device_name=DEVICE, **SHAPE) == config_of(ENTRIES['8192'])  # a table first
    # float32 experts: neither the tables nor the large tiles (their operands would outgrow shared memory)
    small = moe.MoeConfig(64, (64, 64, 4, 3), (64, 64, 4, 3))
    assert moe.default_config(256 * 64, device_name=DEVICE, half=False, **SHAPE) == small
    assert moe.default_config(10 ** 6, 512, half=False) == small


def test_the_environment_folder_comes_first(table_dir, tmp_path_factory, monkeypatch):
    shipped = tmp_path_factory.mktemp('shipped')
    monkeypatch.setattr(moe, '_CONFIG_DIR', str(shipped))
    write(shipped, ENTRIES)
    assert moe.table_pair_counts(device_name=DEVICE, **SHAPE) == [8, 1024, 8192]   # only the package has one
    moe._table.cache_clear()
    moe._call_config.cache_clear()
    write(table_dir, {'8': ENTRIES['8']})
    assert moe.table_pair_counts(device_name=DEVICE, **SHAPE) == [8]


def test_a_malformed_table_is_a_clear_error(table_dir):
    path = os.path.join(table_dir, moe.config_file_name(64, 2048, 512, DEVICE))
    with open(path, 'w') as f:
        f.write('{"configs": {"8": [16, [64]]}}')
    with pytest.raises(ValueError, match='bad MoE tile table'):
        moe.default_config(8, device_name=DEVICE, **SHAPE)


@pytest.mark.parametrize('top_k', [1, 8, 10])
def test_warm_up_counts_reach_every_binary(table_dir, top_k):
    """Every token count up to the limit picks a (config, pair-count class, alignment launch, program order) that
    one warm-up count also picks, and the warm-up counts are few; both program orders among them (the column tiles
    first from 128 rows an expert: 1,024 tokens at top-8)."""
    write(table_dir, ENTRIES)
    max_tokens = 3000
    order = lambda tokens: tokens * top_k >= moe.COLS_FIRST_ROWS * SHAPE['num_experts']  # noqa: E731
    counts = moe.warm_up_token_counts(top_k=top_k, max_tokens=max_tokens, device_name=DEVICE, **SHAPE)
    key = lambda tokens: (moe.default_config(tokens * top_k, device_name=DEVICE, **SHAPE),  # noqa: E731
                          arg_key(tokens * top_k), moe_align.align_launch_key(tokens * top_k), order(tokens))
    warmed = {key(t) for t in counts}
    assert all(key(t) in warmed for t in range(1, max_tokens + 1))
    assert len(counts) == len(warmed) <= 5 * len(ENTRIES) and all(1 <= t <= max_tokens for t in counts)
    assert {k[-1] for k in warmed} == {False, order(max_tokens)}   # top-1: 3,000 pairs, never 128 rows an expert
    untuned = moe.warm_up_token_counts(top_k=top_k, max_tokens=max_tokens, device_name='Other GPU', **SHAPE)
    key = lambda tokens: (moe.default_config(tokens * top_k, SHAPE['num_experts']),  # noqa: E731
                          arg_key(tokens * top_k), moe_align.align_launch_key(tokens * top_k), order(tokens))
    assert {key(t) for t in untuned} == {key(t) for t in range(1, max_tokens + 1)}   # no table: the untuned tiles
    fp32 = moe.warm_up_token_counts(top_k=top_k, max_tokens=max_tokens, device_name=DEVICE, half=False, **SHAPE)
    key = lambda tokens: (moe.default_config(tokens * top_k, device_name=DEVICE, half=False, **SHAPE),  # noqa: E731
                          arg_key(tokens * top_k), moe_align.align_launch_key(tokens * top_k), order(tokens))
    assert {key(t) for t in fp32} == {key(t) for t in range(1, max_tokens + 1)}      # float32: never the table's


def test_shipped_tables_are_well_formed():
    """Every table in the package parses, and each entry's tiles are powers of two of at least 16."""
    folder = moe._CONFIG_DIR
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names:
        with open(os.path.join(folder, name)) as f:
            raw = json.load(f)
        for pairs, (bm, up, down) in raw['configs'].items():
            assert int(pairs) > 0
            for v in (bm, *up[:2], *down[:2]):
                assert v >= 16 and v & (v - 1) == 0, f'{name}: {pairs}: {v}'
            assert up[2] in (1, 2, 4, 8, 16) and down[2] in (1, 2, 4, 8, 16)


def test_the_alignment_mode_is_checked(monkeypatch):
    for mode in ('one', 'three', 'triton', 'torch'):
        monkeypatch.setenv('LMDEPLOY_MOE_ALIGN', mode)
        assert moe_align.align_mode() == mode
    monkeypatch.delenv('LMDEPLOY_MOE_ALIGN')
    assert moe_align.align_mode() == 'one'
    monkeypatch.setenv('LMDEPLOY_MOE_ALIGN', 'two')
    with pytest.raises(ValueError, match="LMDEPLOY_MOE_ALIGN must be one of 'one', 'three', 'triton', 'torch', got "
                                         "'two'"):
        moe_align.align_mode()


@pytest.mark.parametrize('mode, forms', [('one', ('one', 'one', 'two')), ('three', ('one', 'one', 'three')),
                                         ('triton', ('three', 'three', 'three'))])
def test_the_alignment_form_by_pair_count(monkeypatch, mode, forms):
    """One program up to ONE_LAUNCH_PAIRS pairs unless every count takes three launches; above, the mode's form."""
    monkeypatch.setattr(moe_align, '_MODE', mode)
    limit = moe_align.ONE_LAUNCH_PAIRS
    assert tuple(moe_align.align_form(n) for n in (1, limit, limit + 1)) == forms
    with pytest.raises(ValueError, match="form must be 'one', 'two' or 'three', got 'four'"):
        moe_align.align_pairs(torch.zeros(2, 2, dtype=torch.int64), 4, 16, form='four')


def test_the_alignment_compiles_its_sizes_unspecialized():
    """No pair count selects an alignment binary of its own through its size arguments (a block bound or program
    count divisible by 16, or equal to 1): the warm-up's key (`align_launch_key`) holds only the form and width."""
    sizes = {moe_align._count_kernel: ['num_pairs'], moe_align._scatter_kernel: ['num_pairs'],
             moe_align._offsets_kernel: ['num_pairs', 'max_blocks'],
             moe_align._align_one_kernel: ['num_pairs', 'max_blocks'],
             moe_align._histogram_kernel: ['num_pairs'],
             moe_align._place_kernel: ['num_pairs', 'num_programs', 'max_blocks']}
    for kernel, names in sizes.items():
        params = {p.name: p for p in kernel.fn.params}
        ints = [n for n, p in params.items() if not p.is_constexpr and not n.endswith('_ptr')]
        assert set(ints) - {'num_experts'} == set(names), (kernel.fn.__name__, ints)
        assert all(params[n].do_not_specialize for n in names), kernel.fn.__name__


def test_the_two_launch_cursors_stay_16_byte_aligned(monkeypatch):
    """The placing launch's cursor rows start 16-byte aligned at every program count (Triton specializes pointers
    on it, and the warm-up's key does not name it); the launches recorded, not run."""
    offsets = []

    class Record:
        def __init__(self, arg: int | None):
            self.arg = arg

        def __getitem__(self, grid):
            return lambda *args, **kwargs: None if self.arg is None else offsets.append(
                (args[2].data_ptr() - args[1].data_ptr()) % 16)

    monkeypatch.setattr(moe_align, '_histogram_kernel', Record(None))
    monkeypatch.setattr(moe_align, '_place_kernel', Record(2))
    for programs in range(3, 12):
        ids = torch.zeros(programs * 1024 - 5, 1, dtype=torch.int64)
        for experts in (64, 65, 7):
            moe_align.align_pairs(ids, experts, 16, form='two')
    assert len(offsets) == 27 and set(offsets) == {0}


@pytest.mark.parametrize('top_k, experts', [(8, 64), (10, 64), (2, 4)])
def test_fp8_warm_up_counts_reach_every_binary(top_k, experts):
    """Block-wise FP8 experts: every token count up to the limit picks a (BLOCK_M, pair-count class, alignment
    launch, program order) that one warm-up count also picks; BLOCK_M 32 in the two-launch alignment (which the
    eager warm-up's counts miss at top-8 of 64 experts) among them."""
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8_moe
    key = lambda tokens: (moe.row_block(tokens * top_k, experts), arg_key(tokens * top_k),  # noqa: E731
                          moe_align.align_launch_key(tokens * top_k),
                          tokens * top_k >= moe.COLS_FIRST_ROWS * experts)
    counts = blocked_fp8_moe.warm_up_token_counts(experts, top_k, 3000)
    assert {key(t) for t in counts} == {key(t) for t in range(1, 3001)} and len(counts) == len(set(map(key, counts)))
    if (top_k, experts) == (8, 64):
        assert (32, ('two', 0)) in {(k[0], k[2]) for k in map(key, counts)}


@pytest.mark.parametrize('mode, small, large', [('auto', False, True), ('0', False, False), ('1', True, True)])
def test_program_order_by_rows_an_expert(monkeypatch, mode, small, large):
    """The expert GEMMs launch a row block's column tiles together from 128 rows an expert (LMDEPLOY_MOE_COLS_FIRST
    unset), at every count with =1, never with =0, and never where the row blocks could outnumber a grid's second
    dimension (65,535); the grid's dimensions follow."""
    monkeypatch.setattr(moe, '_COLS_FIRST_MODE', mode)
    experts = SHAPE['num_experts']
    rows = moe.COLS_FIRST_ROWS * experts
    assert moe.COLS_FIRST_ROWS == 128
    assert (moe.cols_first(rows - 1, experts, 64), moe.cols_first(rows, experts, 64)) == (small, large)
    assert moe.cols_first(rows, 2 * experts, 64) == small    # rows an expert, not pairs
    # 1M pairs: 65,536 + 65 row blocks at BLOCK_M 16 (with a shared expert's), 8,257 at BLOCK_M 128
    assert (moe.cols_first(1 << 20, experts, 16), moe.cols_first(1 << 20, experts, 128)) == (False, large)
    most = (moe.MAX_GRID_Y - experts - 1) * 16   # the most pairs whose blocks still fit at BLOCK_M 16
    assert moe_align.block_bound(most, experts + 1, 16) == moe.MAX_GRID_Y
    assert (moe.cols_first(most, experts, 16), moe.cols_first(most + 1, experts, 16)) == (large, False)
    assert moe.expert_grid(70, 8, False) == (70, 8) and moe.expert_grid(70, 8, True) == (8, 70)
    with pytest.raises(AssertionError, match='more than a grid dimension'):
        moe.expert_grid(70000, 8, True)


def test_program_order_rejects_a_bad_setting():
    """An LMDEPLOY_MOE_COLS_FIRST other than 0, 1 or auto is refused when the module loads, naming the values."""
    import subprocess
    import sys
    env = dict(os.environ, LMDEPLOY_MOE_COLS_FIRST='yes', CUDA_VISIBLE_DEVICES='')
    run = subprocess.run([sys.executable, '-c', 'import lmdeploy.pytorch.kernels.cuda.moe'], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "LMDEPLOY_MOE_COLS_FIRST='yes': expected 0, 1 or auto" in run.stderr
