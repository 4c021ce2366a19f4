"""`GenerationConfig.validate`: every field is type- and range-checked and the error names the field."""
from __future__ import annotations

import dataclasses
import math

import pytest

from lmdeploy.messages import GENERATION_CHECKS, GenerationConfig, StructuredOutput

# For each field: values of the wrong type or out of range (bool is not an int, an int is not a bool, floats
# must be finite), and values that must pass.
BAD_VALUES = {
    'max_new_tokens': [True, -1, 1.0, '5', None],
    'min_new_tokens': [False, -2, 0.5, None],
    'do_sample': [1, 0, 'yes', None],
    'temperature': [True, -0.1, math.inf, math.nan, '1', None, [1.0]],
    'top_p': [True, 0, 0.0, 1.5, math.nan, -math.inf, '0.5', None],
    'top_k': [True, -1, 2.0, None],
    'repetition_penalty': [True, 0, -1.0, math.inf, math.nan, None],
    'stop_words': ['stop', [''], [1], [None], ['ok', b'bytes'], {'a': 1}],
    'stop_token_ids': [5, [True], [-1], [1.0], ['1'], 'abc'],
    'ignore_eos': [1, None, 'true'],
    'random_seed': [True, 2**64, -2**63 - 1, 1.0, '7'],
    'logprobs': [True, -1, 65, 2.0],
    'adapter_name': ['', 5, ['a']],
    'return_routed_experts': [1, None, 'true'],
    'n': [0, True, 129, 2.0, None],
    'presence_penalty': [True, 2.5, -3, math.nan, None],
    'frequency_penalty': [math.inf, '1', None],
    'min_p': [-0.1, 1.5, math.nan, True],
    'logit_bias': [{'1': 1.0}, {1: 101}, {-1: 0}, {1: math.inf}, {True: 1}, [(1, 1.0)]],
    'structured_output': ['{"type": "object"}', StructuredOutput('yaml', 'x'), StructuredOutput('regex', ''),
                          StructuredOutput('json_schema')],
}
GOOD_VALUES = {
    'max_new_tokens': [0, 10**9], 'min_new_tokens': [0, 3], 'do_sample': [True, False],
    'temperature': [0, 0.0, 2, 1e30], 'top_p': [1, 1e-9, 0.5], 'top_k': [0, 50],
    'repetition_penalty': [1, 1e-3, 2.5], 'stop_words': [None, [], ['a', 'bc']],
    'stop_token_ids': [None, [], [0, 7]], 'ignore_eos': [True, False],
    'random_seed': [None, 0, -2**63, 2**64 - 1], 'logprobs': [None, 0, 64], 'adapter_name': [None, 'sql'],
    'return_routed_experts': [True, False],
    'n': [1, 128], 'presence_penalty': [0, -2, 2, 0.5], 'frequency_penalty': [0.0, -1.5],
    'min_p': [0, 0.05, 1], 'logit_bias': [None, {}, {0: -100, 7: 100.0, 3: 0}],
    'structured_output': [None, StructuredOutput('json_object'), StructuredOutput('regex', 'a+'),
                          StructuredOutput('grammar', 'root ::= "x"')],
}


def test_every_field_has_a_check_and_a_test():
    names = {f.name for f in dataclasses.fields(GenerationConfig)}
    assert set(GENERATION_CHECKS) == names
    assert set(BAD_VALUES) == names and set(GOOD_VALUES) == names


@pytest.mark.parametrize('field,value', [(f, v) for f, values in BAD_VALUES.items() for v in values],
                         ids=lambda x: repr(x)[:20])
def test_bad_value_is_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        GenerationConfig(**{field: value}).validate()
    assert str(info.value).startswith(f'{field} must be '), info.value


@pytest.mark.parametrize('field,value', [(f, v) for f, values in GOOD_VALUES.items() for v in values],
                         ids=lambda x: repr(x)[:20])
def test_good_value_passes(field, value):
    GenerationConfig(**{field: value}).validate()
