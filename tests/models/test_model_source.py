"""Model names: local folders as they are, Hugging Face Hub ids through huggingface_hub's cache (offline here),
revisions, and one clear line for a model that cannot be found."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from lmdeploy.pytorch.models.model_source import ModelNotFoundError, is_hub_id, resolve_model_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REV_MAIN, REV_OLD = 'a' * 40, 'b' * 40


def populate_hub_cache(hub_cache: str, repo_id: str, model_folder: str) -> dict[str, str]:
    """The layout huggingface_hub writes: models--org--name/{blobs,snapshots/<rev>/...,refs/main}; two revisions,
    `main` pointing at REV_MAIN. Returns revision -> snapshot folder."""
    repo = os.path.join(hub_cache, 'models--' + repo_id.replace('/', '--'))
    snapshots = {}
    for rev in (REV_MAIN, REV_OLD):
        snapshot = os.path.join(repo, 'snapshots', rev)
        shutil.copytree(model_folder, snapshot)
        with open(os.path.join(snapshot, 'revision.txt'), 'w') as f:
            f.write(rev)
        snapshots[rev] = snapshot
    os.makedirs(os.path.join(repo, 'refs'))
    with open(os.path.join(repo, 'refs', 'main'), 'w') as f:
        f.write(REV_MAIN)
    return snapshots


def offline_env(hf_home: str) -> dict[str, str]:
    return {**os.environ, 'HF_HOME': hf_home, 'HF_HUB_CACHE': os.path.join(hf_home, 'hub'), 'HF_HUB_OFFLINE': '1',
            'PYTHONPATH': os.pathsep.join([REPO_ROOT, os.environ.get('PYTHONPATH', '')]), 'OMP_NUM_THREADS': '1'}


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_HOME / HF_HUB_OFFLINE when imported, so each case runs in a fresh interpreter
    return subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)


def test_local_folders_resolve_to_themselves(tiny_model_factory, tmp_path):
    path = tiny_model_factory('qwen3')
    assert resolve_model_path(path) == path
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ModelNotFoundError, match='not a Hugging Face model folder'):
        resolve_model_path(str(tmp_path / 'empty'))
    with pytest.raises(ModelNotFoundError, match='no such folder, and not a Hugging Face Hub id'):
        resolve_model_path(str(tmp_path / 'missing'))


def test_hub_id_shapes():
    assert is_hub_id('Qwen/Qwen3.5-9B') and is_hub_id('gpt2')
    assert not is_hub_id('./model') and not is_hub_id('/abs/model') and not is_hub_id('a/b/c')


def test_hub_id_resolves_from_the_offline_cache_and_serves(tiny_model_factory, tmp_path):
    snapshots = populate_hub_cache(str(tmp_path / 'hf' / 'hub'), 'tiny-org/tiny-qwen3', tiny_model_factory('qwen3'))
    code = f'''
from lmdeploy.pytorch.models.model_source import resolve_model_path
print(resolve_model_path('tiny-org/tiny-qwen3'))
print(resolve_model_path('tiny-org/tiny-qwen3', revision='{REV_OLD}'))
from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
with pipeline('tiny-org/tiny-qwen3', PytorchEngineConfig(device_type='cpu', num_gpu_blocks=16)) as pipe:
    print(pipe.async_engine.model_name)
    print(len(pipe('hello', GenerationConfig(max_new_tokens=3, ignore_eos=True)).token_ids))
'''
    proc = run_python(code, offline_env(str(tmp_path / 'hf')))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split('\n')
    assert lines[:4] == [snapshots[REV_MAIN], snapshots[REV_OLD], 'tiny-org/tiny-qwen3', '3'], proc.stdout


@pytest.mark.parametrize('argv,message', [
    (['serve', 'api_server', 'nobody/no-such-model'],
     "lmdeploy: error: model 'nobody/no-such-model' is not in the Hugging Face cache and HF_HUB_OFFLINE is set"),
    (['chat', './no/such/folder'], "lmdeploy: error: model './no/such/folder' not found: no such folder"),
])
def test_a_missing_model_is_one_line_not_a_traceback(tmp_path, argv, message):
    code = f'import sys; from lmdeploy.cli.entrypoint import main; sys.exit(main({argv!r}))'
    proc = run_python(code, offline_env(str(tmp_path / 'hf')))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith(message), proc.stderr
    assert 'Traceback' not in proc.stderr
