"""Where a model's files are: a local folder, or a Hugging Face Hub id resolved through `huggingface_hub`.

A local folder is used as it is. Anything else that looks like a hub id (`name` or `org/name`) goes to
`huggingface_hub.snapshot_download`, which honours its cache (`HF_HOME` / `HF_HUB_CACHE`, or `download_dir`), the
`revision` (branch, tag or commit) and `HF_HUB_OFFLINE=1` (cache only). Every way of not finding the model raises
`ModelNotFoundError` with one line that says what to do; callers at the top (the CLI) print just that line.
"""
from __future__ import annotations

import os
import re

# What is fetched: config, tokenizer, chat template, generation config, and (unless only the config is wanted)
# safetensors weights. `.bin` / `.pth` weights are never fetched: the loader reads safetensors only.
_CONFIG_PATTERNS = ['*.json', '*.txt', '*.model', '*.tiktoken', '*.jinja', 'tokenizer*']
_WEIGHT_PATTERNS = ['*.safetensors']
_HUB_ID = re.compile(r'^[\w.-]+(/[\w.-]+)?$')


class ModelNotFoundError(ValueError):
    """The model names neither a model folder nor a reachable / cached Hugging Face Hub repository."""


def is_hub_id(model: str) -> bool:
    """True for `org/name` or `name` strings that are not an existing local path."""
    return not os.path.exists(model) and not model.startswith(('.', '/', '~')) and bool(_HUB_ID.match(model))


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None,
                       with_weights: bool = True) -> str:
    """A local folder holding `model`'s files (downloading or reading the hub cache for a hub id)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, 'config.json')) and not _has_tokenizer(path):
            raise ModelNotFoundError(f'{model!r} is a folder but not a Hugging Face model folder (no config.json)')
        return path
    if not is_hub_id(model):
        raise ModelNotFoundError(f'model {model!r} not found: no such folder, and not a Hugging Face Hub id')
    return _snapshot(model, revision, download_dir, with_weights)


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ('tokenizer.json', 'tokenizer_config.json'))


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, with_weights: bool) -> str:
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError as err:  # pragma: no cover - huggingface_hub is a runtime requirement
        raise ModelNotFoundError(f'{repo_id!r} is not a local folder and huggingface_hub is not installed') from err
    where = f'{repo_id!r}' + (f' (revision {revision!r})' if revision else '')
    patterns = _CONFIG_PATTERNS + (_WEIGHT_PATTERNS if with_weights else [])
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                                 allow_patterns=patterns)
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(f'model {where}: no such revision on the Hugging Face Hub') from None
    except errors.GatedRepoError:
        raise ModelNotFoundError(f'model {where} is gated: accept its terms on huggingface.co and log in '
                                 '(`hf auth login` or HF_TOKEN)') from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFoundError(f'model {where} not found: no such local folder or Hugging Face Hub repository '
                                 '(private repositories need HF_TOKEN)') from None
    except errors.LocalEntryNotFoundError:
        offline = os.environ.get('HF_HUB_OFFLINE', '').lower() in ('1', 'true', 'yes', 'on')
        hint = 'HF_HUB_OFFLINE is set' if offline else 'the Hub cannot be reached'
        raise ModelNotFoundError(f'model {where} is not in the Hugging Face cache and {hint}') from None
    except errors.HFValidationError as err:
        raise ModelNotFoundError(f'model {repo_id!r} is neither a folder nor a valid hub id: {err}') from None
    except (OSError, errors.HfHubHTTPError) as err:
        raise ModelNotFoundError(f'model {where} could not be fetched: {str(err).splitlines()[0]}') from None
