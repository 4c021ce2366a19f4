"""Speculative decoding (MTP) at engine build: which configurations may speculate, and the `SpeculativeStep` the
engine's step calls. Holds no state.

Order (`Engine.__init__`): `num_draft_tokens` before any weight is read (a refused combination costs no load) ->
the model with its MTP head, the pools (room for the drafts), the agent with its graphs (`make_agent_spec`) ->
`build_speculative` once the inputs maker exists. With speculation off both are no-ops: the engine's step then
never enters `spec_step`.
"""
from __future__ import annotations

from ...messages import PytorchEngineConfig
from .inputs_maker import InputsMaker
from .spec_step import SpeculativeStep


def num_draft_tokens(cfg: PytorchEngineConfig) -> int:
    """Draft tokens per verify step (0: no speculation); `ValueError` for a combination not supported yet."""
    speculative = cfg.speculative_config
    if speculative is None:
        return 0
    if cfg.enable_return_routed_experts:
        raise ValueError('speculative decoding and enable_return_routed_experts cannot be combined yet (a verify '
                         'forward also routes draft tokens that may be rejected)')
    return speculative.num_speculative_tokens


def build_speculative(agent, inputs_maker: InputsMaker, num_draft_tokens: int, session_len: int
                      ) -> SpeculativeStep | None:
    """The agent's speculative decoder and the engine's step glue; None without draft tokens."""
    if not num_draft_tokens:
        return None
    agent.enable_speculative(num_draft_tokens)
    return SpeculativeStep(agent, inputs_maker, num_draft_tokens, session_len)
