"""Every rank's half of a speculative step: draft, write the drafts into the verify rows, run the target.

Order on each rank (the same on all, so the collectives inside pair up): the drafter consumes the
positions it lags behind on and proposes k drafts (device drafters), the drafts fill the verify rows'
input ids, the target runs (a captured (batch bucket, k) graph for pure decode steps, else eagerly),
EAGLE-3 features are stored at the step's KV slots, and the logits of the sampled prefill rows and
of every verify position are computed in one call. Rank 0 then verifies (spec_decoder.py).

The plain runner knows none of this: execute_spec takes it and finds its SpecWorker through its hook
(spec_worker.worker_of); step_executor(executor) is how SpecDecoder runs a step on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from tpfuse.engine.runner import ModelRunner
from tpfuse.engine.spec_chain import ChainLink, shift_by_accepted
from tpfuse.engine.spec_inputs import SpecInputs, read_spec_header, unpack_spec
from tpfuse.engine.spec_worker import worker_of
from tpfuse.engine.step_inputs import StepInputs, read_header, unpack_step
from tpfuse.spec.drafter import DraftProposal
from tpfuse.spec.tree import DraftTree, ancestor_matrix, tree_attention_bits


@dataclass
class SpecForward:
    step: StepInputs
    spec: SpecInputs
    sample_logits: torch.Tensor | None  # [N, V] float32: prefill rows that reached their end
    verify_logits: torch.Tensor | None  # [D, k+1, V] float32
    proposal: DraftProposal | DraftTree | None  # device drafters' proposal for the verify rows


def _place_tree(step: StepInputs, spec: SpecInputs, tree: DraftTree, max_depth: int) -> torch.Tensor:
    """Writes the tree's draft tokens and positions (root position + depth) into the verify rows;
    returns the [T] tree mask (-1, plain causal, outside the verify rows)."""
    rows = spec.verify_indices.view(tree.parents.shape)
    step.input_ids[rows[:, 1:].reshape(-1)] = tree.token_ids[:, 1:].reshape(-1)
    root_positions = step.positions[rows[:, 0]]
    step.positions[rows.reshape(-1)] = (root_positions[:, None] + tree.depths).reshape(-1)
    mask = torch.full_like(step.input_ids, -1)
    mask[rows.reshape(-1)] = tree_attention_bits(ancestor_matrix(tree.parents, max_depth))
    return mask


def execute_spec(runner: ModelRunner, packed: torch.Tensor, link: ChainLink | None = None) -> SpecForward:
    """Every rank: draft, verify forward and logits of a speculative packed step on this rank's runner
    (built with spec_worker.speculative_hook). link: the step in flight when packed is a chained
    template (spec_chain.py); the device shifts the template by that step's verify result."""
    return run_spec_forward(runner, packed, link.shift() if link is not None else None)


def step_executor(executor) -> Callable[[torch.Tensor, ChainLink | None], SpecForward]:
    """(packed, link) -> rank 0's SpecForward, run on every rank of executor: at TP = 1 execute_spec on
    its runner; a tensor-parallel group's own execute_spec publishes the step to the workers first."""
    if executor.runner.config.tp_size == 1:
        return partial(execute_spec, executor.runner)
    return executor.execute_spec


@torch.inference_mode()
def run_spec_forward(runner: ModelRunner, packed: torch.Tensor, shift=None) -> SpecForward:
    """runner: this rank's ModelRunner (with a SpecWorker hook); packed: the CPU packed speculative
    step. shift: (accepted, emitted, k') of the step before when packed is a chained template: the
    device copy is shifted by them first (spec_chain.shift_by_accepted)."""
    header = read_header(packed)
    spec_header = read_spec_header(packed, header)
    device_packed = runner.upload.to_device(packed)
    step = unpack_step(header, device_packed, packed)
    spec = unpack_spec(header, spec_header, device_packed)
    if shift is not None:
        accepted, emitted, max_shift = shift
        shift_by_accepted(step, spec, accepted, emitted, runner.block_size, max_shift)
    k, num_decode = spec_header.num_draft_tokens, spec_header.num_decode
    graphs, worker = runner.graphs, worker_of(runner)
    if spec_header.ext_window:
        return _run_window_step(runner, step, spec, k)
    worker.apply_kv_moves(spec, runner.kv_caches)
    proposal = worker.propose(step, spec, runner.block_size)
    attn = step.attention_metadata()
    if isinstance(proposal, DraftTree):
        attn.tree_mask = _place_tree(step, spec, proposal, worker.max_num_draft_tokens)
    elif proposal is not None and k > 0:
        draft_at = spec.verify_indices.view(num_decode, k + 1)[:, 1:].reshape(-1)
        step.input_ids[draft_at] = proposal.token_ids.reshape(-1)
    tree = spec_header.tree and k > 0  # tree steps run eagerly
    # verify graphs that draft inside (graphs.fills_extra_rows) need a window step; k = 0 graphs never do
    drafts_inside = graphs is not None and graphs.fills_extra_rows and k > 0
    graphable = spec_header.pure_decode and not tree and graphs is not None and not drafts_inside
    if graphable and graphs.has(header.num_seqs, k):
        return _replay(graphs, runner.model, step, spec, k, proposal)
    return _eager_forward(runner, step, spec, attn, proposal)


def _replay(graphs, model, step: StepInputs, spec: SpecInputs, k: int, proposal) -> SpecForward:
    out = graphs.run(step, k)
    rows = out.index_select(0, spec.verify_indices)
    verify = rows if graphs.graph_logits else model.compute_logits(rows)
    return SpecForward(step, spec, None, verify.view(spec.header.num_decode, k + 1, -1), proposal)


def _eager_forward(runner, step: StepInputs, spec: SpecInputs, attn, proposal) -> SpecForward:
    model, header, k = runner.model, step.header, spec.header.num_draft_tokens
    hidden, aux = runner.forward_tokens(step, attn)
    worker_of(runner).write_features(aux, step.slot_mapping)
    indices = torch.cat([step.sample_indices, spec.verify_indices])
    if indices.numel() == 0:
        return SpecForward(step, spec, None, None, proposal)
    logits = model.compute_logits(hidden.index_select(0, indices))
    num_samples, num_decode = header.num_samples, spec.header.num_decode
    sample_logits = logits[:num_samples] if num_samples else None
    verify = logits[num_samples:].view(num_decode, k + 1, -1) if num_decode else None
    return SpecForward(step, spec, sample_logits, verify, proposal)


def _int32_tables(step: StepInputs) -> torch.Tensor:
    """The step's block tables as int32, as the graphs hold them: the attention kernels compile a
    variant per table dtype, so eager drafting must not bring a second one."""
    return step.block_tables.to(torch.int32)


def _run_window_step(runner, step: StepInputs, spec: SpecInputs, k: int) -> SpecForward:
    """A window step (pure decode, EAGLE-3 chain): the window drafter extends and drafts, then the
    target verifies; all inside one graph replay when the (bucket, k > 0) graph exists (at k = 0 the
    window extension runs eagerly before the plain decode graph)."""
    drafter, graphs = worker_of(runner).window_drafter, runner.graphs
    num_rows, num_decode = step.header.num_seqs, spec.header.num_decode
    drafter.load(spec, num_rows)
    if k == 0 and graphs is not None and graphs.has(num_rows, 0):  # k = 0 graphs are plain decodes
        drafter.draft(num_rows, 0, _int32_tables(step))
        forward = _replay(graphs, runner.model, step, spec, 0, None)
    elif graphs is not None and graphs.fills_extra_rows and graphs.has(num_rows, k):
        forward = _replay(graphs, runner.model, step, spec, k, None)
    else:
        drafts = drafter.draft(num_rows, k, _int32_tables(step))
        if k:
            step.input_ids.view(num_rows, k + 1)[:, 1:].copy_(drafts)
        forward = _eager_forward(runner, step, spec, step.attention_metadata(), None)
    if k:
        forward.proposal = DraftProposal(drafter.drafts[:num_decode, :k], spec.num_drafts)
    return forward
