"""`request_checks.prompt_array`: the prompt check that also hands the engine its int64 array (the conversion the
check makes, adopted by the request instead of a second one), against the list it was given."""
from __future__ import annotations

import numpy as np
import pytest

from lmdeploy.pytorch.engine.request_checks import check_prompt, prompt_array


@pytest.mark.parametrize('ids', [[0], [3, 1, 2], list(range(1000)), [np.int32(4), 5], [True, 2]])
def test_prompt_array_is_a_new_int64_copy_of_the_prompt(ids):
    out = prompt_array(ids, vocab_size=1000, session_len=2000)
    assert out.dtype == np.int64 and out.tolist() == [int(t) for t in ids]
    out[0] = 999  # a copy: the caller's list is untouched
    assert ids[0] != 999


@pytest.mark.parametrize(('ids', 'message'), [
    ([], 'the prompt is empty'),
    ([1, 1000], r'out of the vocabulary \[0, 1000\): \[1000\]'),
    ([-1, 2], r'\[-1\]'),
    ([1.5, 2], r'\[1.5\]'),
    (['5', 3], r"\['5'\]"),
    ([2 ** 70], 'out of the vocabulary'),
    ([[1, 2]], 'out of the vocabulary'),
    (list(range(20)), 'session_len is 20'),
])
def test_prompt_array_rejects_what_check_prompt_rejects(ids, message):
    for check in (prompt_array, check_prompt):
        with pytest.raises(ValueError, match=message):
            check(ids, 1000, 20)


def test_prompt_array_room_is_capacity_past_the_prompt_that_appends_fill_without_a_copy():
    from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence
    ids = list(range(5, 105))
    out = prompt_array(ids, vocab_size=1000, session_len=2000, room=16)
    assert len(out) == 116 and out[:100].tolist() == ids
    seq = SchedulerSequence(seq_id=1, token_ids=list(ids), num_prompt_tokens=100, sampling=SamplingParams())
    seq.adopt_token_array(out)
    assert seq.token_array().tolist() == ids
    for t in range(16):   # within the room: written into the adopted buffer in place
        seq.token_ids.append(t)
        assert np.shares_memory(seq.token_array(), out)
    seq.token_ids.append(99)   # past it: grown into a new buffer, same contents
    view = seq.token_array()
    assert not np.shares_memory(view, out) and view.tolist() == seq.token_ids


def test_engine_gives_a_prompt_room_for_its_reply_up_to_the_prompt_length(tiny_model_factory):
    """`Engine.add_request`: room for min(max_new_tokens, prompt length, REPLY_ROOM) reply tokens, and the request
    generates into it (its token array the adopted buffer until the reply outgrows the room)."""
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.pytorch.messages import SamplingParams
    engine = Engine(tiny_model_factory('qwen3_5'), PytorchEngineConfig(device_type='cpu', num_gpu_blocks=32))
    rooms = {}
    for n, max_new in ((40, 8), (20, 1000), (30, 0)):
        seq_id = engine.add_request(list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new))
        engine.step()   # runs the queued command: the sequence is now the engine's
        seq = engine._seqs[seq_id][0] if seq_id in engine._seqs else None
        rooms[n] = None if seq is None else len(seq._array) - n
    assert rooms[40] == 8 and rooms[20] == 20
    engine.run_until_idle()
