"""Device side of a speculative (MTP) step: the verify forward with its acceptance, then the draft head.

Owns no persistent state beyond the model and the pools it is given. Order, all on the forward stream (the
`ModelAgent` wraps each call in it), within one engine step:

1. `verify`: restore copies -> read the restored hidden of the sequences resuming from a hit -> target forward
   (pre-norm hidden states kept) -> every fed row's hidden goes to `CacheEngine.mtp_hidden` of the state row that
   holds the state after it (runtime rows, in-prefill cuts, draft cuts) -> logits of each sampled sequence's last
   real token and its drafts -> acceptance (greedy exact; otherwise rejection sampling against the draft
   distributions the drafts were drawn from) -> the emitted runs, on the host.
2. (the scheduler appends the runs and plans the state fix-ups)
3. `draft`: fix-up copies (spare row -> runtime row) -> the head's catch-up over the committed positions -> save
   copies (checkpoints; after the catch-up, so a frozen partial block holds the head's KV too) -> the first draft
   from the catch-up's last row, then K - 1 chained head steps (each reads the previous step's head output and
   draft; all greedy: one replay of the whole chain, `spec_chain`) -> the drafts, on the host.

Host reads: the verify reads its results in one pinned copy (greedy rows; a sampled row's rejection sampling reads
its own), the draft its drafts in one; the plans' index tensors go up in one non-blocking copy each.

A draft override (`set_draft_override`, for forced-acceptance tests and benchmarks) replaces the head's proposals
after the head ran, so the cost and every write of the head stay as they are. For a sampled request the overridden
drafts count as drawn from a point mass (q one-hot), which keeps rejection sampling exact.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..backends.default.sampling import _filter_min_p, _filter_top_k_top_p, _top_logprobs
from ..messages import SchedulerSequence
from ..model_inputs import ModelInputs, SamplingInputs, upload_index_tensors
from .async_scheduling import DeviceTokens
from .spec_acceptance import greedy_accept, rejection_sample
from .spec_inputs import HeadPlan, VerifyPlan

# (sequence, the head's greedy drafts) -> the drafts to propose instead
DraftOverride = Callable[[SchedulerSequence, list[int]], list[int]]
# (the head's hidden at each drafting sequence's last catch-up row [D, H], chained step 1's inputs) -> the greedy
# drafts [D, K] on the device, or None where it cannot run them (`spec_chain.DraftChainGraphs.run`)
GreedyChain = Callable[[torch.Tensor, ModelInputs], 'torch.Tensor | None']


class VerifyOutput(NamedTuple):
    runs: list[list[int]]             # per sampled sequence: accepted drafts, then the bonus / corrected token
    num_accepted: list[int]           # per sampled sequence (0 for rows without drafts)
    hidden: torch.Tensor              # [T + num_overlap, H]: the verify rows' pre-norm hidden, then the overlaps'
    logits: torch.Tensor | None       # [T, V] of every fed row (on the host), when some sequence collects logits
    first_logits: torch.Tensor        # [S, V] at each sampled sequence's last real token (plain decoding's logits)
    logprobs: list | None             # per sampled sequence, plain sampling's top logprobs (rows without drafts)
    # per sampled sequence with drafts whose request asks for logprobs: the top logprobs of every emitted token of
    # its run, from the target's raw logits at that position (what plain decoding reports); None elsewhere
    run_logprobs: list[list[dict[int, float]] | None] | None = None


class PendingDrafts:
    """The drafts of one draft step with their host copy pending (`DeviceTokens`): `resolve()` waits for that copy
    only, then applies the draft override. The engine resolves after its bookkeeping (deliver, commit, release),
    which so runs while the device drafts."""

    def __init__(self, tokens: DeviceTokens | None, dists: list, seqs: list[SchedulerSequence],
                 override: DraftOverride | None):
        self.tokens, self.dists, self.seqs, self.override = tokens, dists, seqs, override

    def resolve(self) -> tuple[list[list[int]], list]:
        """(drafts per drafting sequence, their draft distributions or None) on the host."""
        if self.tokens is None:
            return [], []
        ids, dists = self.tokens.tolist(), self.dists
        if self.override is not None:
            ids = [list(self.override(seq, row)) for seq, row in zip(self.seqs, ids)]
            # a fixed proposal is a draw from a point mass: rejection sampling stays exact with q = one-hot
            dists = [None if d is None else torch.nn.functional.one_hot(
                torch.tensor(row, device=d.device), d.size(-1)).to(d.dtype) for d, row in zip(dists, ids)]
        return ids, dists


class SampleParams(NamedTuple):
    """One sampled sequence's draw parameters (speculative rows only take these)."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    generator: torch.Generator | None


def sample_params(seq: SchedulerSequence, generators: dict[int, torch.Generator]) -> SampleParams:
    p = seq.sampling
    return SampleParams(p.temperature, p.top_k, p.top_p, p.min_p, generators.get(seq.seq_id))


def processed_probs(logits: torch.Tensor, params: SampleParams) -> torch.Tensor:
    """The distribution plain sampling draws from for these rows ([N, V] logits, one request's parameters): the
    default sampler's temperature, min-p and top-k / top-p filters, then softmax."""
    n = logits.size(0)
    dev = logits.device
    scaled = logits.float() / max(params.temperature, 1e-5)
    if params.min_p > 0:
        scaled = _filter_min_p(scaled, torch.full((n,), params.min_p, device=dev))
    filtered = _filter_top_k_top_p(scaled, torch.full((n,), params.top_k, dtype=torch.int64, device=dev),
                                   torch.full((n,), params.top_p, device=dev))
    return filtered.softmax(dim=-1)


class SpeculativeDecoder:

    def __init__(self, model, cache_engine, sample_op, num_draft_tokens: int):
        self.model = model
        self.cache = cache_engine
        self._sample = sample_op
        self.k = num_draft_tokens
        self.draft_override: DraftOverride | None = None

    # ---- verify -------------------------------------------------------------------------------------------------
    def verify(self, inputs: ModelInputs, target_hidden: Callable[[ModelInputs], torch.Tensor], plan: VerifyPlan,
               sampling: SamplingInputs, params: list[SampleParams | None], collect: bool) -> VerifyOutput:
        """`inputs` on the device (restores already queued); `target_hidden(inputs)` runs the target forward and
        gives its pre-norm hidden states (graph or eager); `params[i]` is None for greedy rows. The plan's index
        tensors travel in one non-blocking copy; without sampled drafts the step reads the host once (the runs)."""
        dev = self.cache.device
        counts = [d + 1 for d in plan.num_drafts]
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        index = upload_index_tensors(dict(
            overlap=torch.tensor(plan.overlap_slots, dtype=torch.int64), hidden=plan.hidden_rows,
            cut_rows=plan.cut_rows, cut_slots=plan.cut_slots, logits=plan.logits_rows,
            first=torch.tensor(starts if counts else [], dtype=torch.int64)), dev)
        hidden_cache = self.cache.mtp_hidden
        overlap = hidden_cache[index['overlap']].clone() if plan.overlap_slots else hidden_cache[:0]
        pre = target_hidden(inputs)
        normed = self.model.final_norm(pre)
        hidden_cache.index_copy_(0, inputs.state_ids, pre[index['hidden']].to(hidden_cache.dtype))
        if plan.cut_slots.numel():
            hidden_cache.index_copy_(0, index['cut_slots'], pre[index['cut_rows']].to(hidden_cache.dtype))
        all_logits = self.model.compute_logits(normed) if collect else None
        logits = all_logits[index['logits']] if all_logits is not None else self.model.compute_logits(
            normed[index['logits']])
        first_logits = logits[index['first']]
        runs, accepted, logprobs = self._accept(logits, first_logits, plan, counts, sampling, params)
        return VerifyOutput(runs, accepted, torch.cat([pre, overlap.to(pre.dtype)]),
                            all_logits.cpu() if all_logits is not None else None, first_logits, logprobs,
                            self._run_logprobs(logits, plan, counts, runs, sampling.max_num_logprobs))

    @staticmethod
    def _run_logprobs(logits: torch.Tensor, plan: VerifyPlan, counts: list[int], runs: list[list[int]],
                      k: int) -> list | None:
        """Top-k logprobs of each emitted token of the drafting rows that ask for them (one batched call):
        token j of a run was sampled from the target's logits at the row's position j (its raw distribution, as
        plain decoding reports it)."""
        rows = [i for i, d in enumerate(plan.num_drafts) if d and plan.wants_logprobs[i]]
        if not rows or k < 0:
            return None
        starts = [sum(counts[:i]) for i in rows]
        index = torch.tensor([s + j for s, i in zip(starts, rows) for j in range(len(runs[i]))], dtype=torch.int64,
                             device=logits.device)
        ids = torch.tensor([t for i in rows for t in runs[i]], dtype=torch.int64, device=logits.device)
        flat = _top_logprobs(logits[index], ids, k)
        out: list = [None] * len(runs)
        at = 0
        for i in rows:
            out[i], at = flat[at:at + len(runs[i])], at + len(runs[i])
        return out

    def _accept(self, logits: torch.Tensor, first_logits: torch.Tensor, plan: VerifyPlan, counts: list[int],
                sampling: SamplingInputs, params: list[SampleParams | None]):
        if not counts:
            return [], [], None
        # Rows without drafts sample their one position exactly as plain decoding does (every sampling option).
        plain_ids, logprobs = self._sample(first_logits, sampling)
        greedy = self._greedy_runs(logits, plan, counts, params, plain_ids)
        plain_ids = greedy.pop('plain')
        runs, accepted = [], []
        for i, chunk in enumerate(logits.split(counts)):
            d = plan.num_drafts[i]
            if d == 0:
                run = [plain_ids[i]]
            elif i in greedy:
                run = greedy[i]
            else:
                drafts = torch.tensor([plan.draft_ids[i]], dtype=torch.int64, device=logits.device)
                target = processed_probs(chunk, params[i])[None]
                result = rejection_sample(drafts, plan.draft_probs[i][:d][None], target, params[i].generator)
                run = result.tokens[0, :int(result.num_accepted[0]) + 1].tolist()
            runs.append(run)
            accepted.append(len(run) - 1)
        return runs, accepted, logprobs

    @staticmethod
    def _greedy_runs(logits: torch.Tensor, plan: VerifyPlan, counts: list[int], params: list[SampleParams | None],
                     plain_ids: torch.Tensor) -> dict:
        """The emitted runs of every greedy row with drafts, by sampled index, and under 'plain' the plain samples
        of every row: one batched `greedy_accept` over rows padded to the longest draft (a padded draft is -1, never
        an argmax), the indices uploaded in one non-blocking copy, the results read back in one pinned copy."""
        rows = [i for i, d in enumerate(plan.num_drafts) if d and params[i] is None]
        if not rows:
            return {'plain': DeviceTokens(plain_ids).tolist()}
        width = max(plan.num_drafts[i] for i in rows)
        starts = [sum(counts[:i]) for i in rows]
        host = dict(index=torch.tensor([[s + min(c, plan.num_drafts[i]) for c in range(width + 1)]
                                        for s, i in zip(starts, rows)], dtype=torch.int64),
                    drafts=torch.tensor([plan.draft_ids[i] + [-1] * (width - plan.num_drafts[i]) for i in rows],
                                        dtype=torch.int64))
        dev = upload_index_tensors(host, logits.device)
        result = greedy_accept(dev['drafts'], logits[dev['index']])
        n, s = len(rows), plain_ids.numel()
        packed = DeviceTokens(torch.cat([plain_ids.to(torch.int64), result.num_accepted,
                                         result.tokens.reshape(-1)])).tolist()
        num, tokens = packed[s:s + n], packed[s + n:]
        runs: dict = {i: tokens[r * (width + 1):r * (width + 1) + num[r] + 1] for r, i in enumerate(rows)}
        runs['plain'] = packed[:s]
        return runs

    # ---- draft --------------------------------------------------------------------------------------------------
    def draft(self, head_hidden: Callable[[torch.Tensor, ModelInputs], torch.Tensor], plan: HeadPlan,
              hidden: torch.Tensor, chain_inputs: Callable[[int], ModelInputs], params: list[SampleParams | None],
              save: Callable[[], None], chain: GreedyChain | None = None) -> PendingDrafts:
        """Catch-up, then `save()`, then the drafts of `plan.drafting` (greedy where `params[i]` is None, else drawn
        from the head's processed distribution, which is returned for rejection sampling). `head_hidden(prev,
        inputs)` runs the head (graph or eager); `chain(prev, chain_inputs(1))`, when given and every drafting
        sequence is greedy, runs the whole greedy chain at once (`spec_chain`; None: it does not fit). The drafts'
        one host read is left pending (`PendingDrafts.resolve`)."""
        index = upload_index_tensors({'hidden': plan.hidden_index, 'last': plan.last_rows}, hidden.device)
        out_hidden = None
        if plan.inputs is not None:
            out_hidden = head_hidden(hidden[index['hidden']], plan.inputs)
        save()
        if not plan.drafting:
            return PendingDrafts(None, [], [], None)
        prev = out_hidden[index['last']]
        drafted = chain(prev, chain_inputs(1)) if chain is not None and all(p is None for p in params) else None
        if drafted is not None:
            tokens, dists = drafted, [None] * len(params)
        else:
            tokens, dists = self._chain_steps(head_hidden, prev, chain_inputs, params)
        return PendingDrafts(DeviceTokens(tokens), dists, [plan.seqs[i] for i in plan.drafting], self.draft_override)

    def _chain_steps(self, head_hidden, prev: torch.Tensor, chain_inputs: Callable[[int], ModelInputs],
                     params: list[SampleParams | None]) -> tuple[torch.Tensor, list]:
        """The chain step by step: draw (eager lm_head), then one head step per further draft. Returns the drafts
        [D, K] on the device and each sampled row's draft distributions [K, V] (None for greedy rows)."""
        drafts, probs = [], []
        for step in range(self.k):
            if step:
                inputs = chain_inputs(step)
                inputs.input_ids = drafts[-1]
                prev = head_hidden(prev, inputs)
            token, prob = self._draw(self.model.compute_logits(prev), params)
            drafts.append(token)
            probs.append(prob)
        dists = [None if p is None else torch.stack([probs[s][i] for s in range(self.k)])
                 for i, p in enumerate(params)]
        return torch.stack(drafts, dim=1), dists

    @staticmethod
    def _draw(logits: torch.Tensor, params: list[SampleParams | None]) -> tuple[torch.Tensor, list]:
        """One draft per row: argmax (greedy rows) or a draw from the processed distribution."""
        token = logits.argmax(dim=-1)
        probs = [None] * len(params)
        for i, p in enumerate(params):
            if p is not None:
                probs[i] = processed_probs(logits[i:i + 1], p)[0]
                token[i] = torch.multinomial(probs[i], 1, generator=p.generator)[0]
        return token, probs
