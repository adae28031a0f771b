"""A minimal speculative decoding loop over a real tpfuse model: the contract the engine implements.

Target side: a verify pass runs each sequence's newest token plus its drafts at positions
L..L+k through the model's forward (prefill attention over the paged cache), verification keeps
a + 1 tokens, and the sequence length grows by a + 1: the KV written for rejected positions lies
beyond the length and is overwritten by the next pass (rollback is only the length). Drafter side:
DraftInputs describe the accepted positions only.
"""

import torch

from tpfuse.spec.drafter import DraftInputs
from tpfuse.spec.paged import metadata_for_positions
from tpfuse.spec.verify import greedy_verify

from .eagle3_reference import PagedSequences


class TinyTarget:
    def __init__(self, model, num_seqs, max_len):
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        self.paged = PagedSequences(num_seqs, max_len, seed=11, device=param.device, dtype=param.dtype)
        c = model.config
        shape = (self.paged.num_blocks, self.paged.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [self.paged.kv_cache(lambda *_: shape) for _ in range(c.num_layers)]

    @torch.inference_mode()
    def forward(self, token_rows, starts):
        """token_rows[b] at positions starts[b]..: returns (logits per row [n_b, V], aux rows)."""
        ids = torch.cat([torch.tensor(r) for r in token_rows])
        positions = torch.cat([torch.arange(s, s + len(r)) for s, r in zip(starts, token_rows, strict=True)])
        lengths = torch.tensor([len(r) for r in token_rows])
        loc = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        ids, positions, loc = ids.to(self.device), positions.to(self.device), loc.to(self.device)
        attn = metadata_for_positions(self.paged.block_tables, self.paged.block_size, positions, loc)
        hidden, aux = self.model(ids, positions, attn, self.kv_caches)
        logits = self.model.compute_logits(hidden)
        splits = lengths.tolist()
        return list(logits.split(splits)), (list(aux.split(splits)) if aux is not None else None)


def greedy_decode(model, prompts, num_tokens):
    """Plain greedy decoding, one token per step (decode attention)."""
    target = TinyTarget(model, len(prompts), max(map(len, prompts)) + num_tokens + 8)
    logits, _ = target.forward(prompts, [0] * len(prompts))
    outputs = [[int(row[-1].argmax())] for row in logits]
    while len(outputs[0]) < num_tokens:
        starts = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]
        logits, _ = target.forward([[o[-1]] for o in outputs], starts)
        for o, row in zip(outputs, logits, strict=True):
            o.append(int(row[-1].argmax()))
    return outputs


def speculative_greedy_decode(model, prompts, num_tokens, make_drafter, num_draft_tokens):
    """Greedy speculative decoding with any Drafter. make_drafter(paged) builds the drafter over the
    target's block tables. Returns (outputs, drafts accepted in total, every step's proposals)."""
    target = TinyTarget(model, len(prompts), max(map(len, prompts)) + num_tokens + 2 * num_draft_tokens + 8)
    drafter = make_drafter(target.paged)
    logits, aux = target.forward(prompts, [0] * len(prompts))
    outputs = [[int(row[-1].argmax())] for row in logits]
    verified = [(0, p, p[1:] + o) for p, o in zip(prompts, outputs, strict=True)]
    accepted_total, proposals = 0, []
    while min(map(len, outputs)) < num_tokens:
        inputs = _draft_inputs(target.paged, verified, aux, prompts, outputs, target.device)
        proposal = drafter.propose(inputs, num_draft_tokens)
        proposals.append(proposal.token_ids.tolist())
        starts = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]
        rows = [[o[-1], *d] for o, d in zip(outputs, proposal.token_ids.tolist(), strict=True)]
        logits, aux_rows = target.forward(rows, starts)
        result = greedy_verify(proposal.token_ids, torch.stack(logits), proposal.num_draft_tokens)
        accepted_total += int(result.num_accepted.sum())
        verified, kept_aux = [], []
        for b, emitted in enumerate(result.emitted_token_ids()):
            kept = rows[b][: len(emitted)]  # the newest token and the accepted drafts
            verified.append((starts[b], kept, emitted))
            outputs[b].extend(emitted)
            if aux_rows is not None:
                kept_aux.append(aux_rows[b][: len(emitted)])
        aux = kept_aux or None
    return [o[:num_tokens] for o in outputs], accepted_total, proposals


def _draft_inputs(paged, verified, aux, prompts, outputs, device):
    """verified[b] = (first position, tokens at the verified positions, the token after each)."""
    lengths = [len(v[1]) for v in verified]
    loc = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return DraftInputs(
        input_ids=torch.cat([torch.tensor(v[1]) for v in verified]).to(device),
        positions=torch.cat([torch.arange(s, s + len(t)) for s, t, _ in verified]).to(device),
        next_token_ids=torch.cat([torch.tensor(v[2]) for v in verified]).to(device),
        query_start_loc=loc.to(device),
        block_tables=paged.block_tables,
        block_size=paged.block_size,
        target_features=torch.cat(aux) if aux is not None else None,
        token_histories=[p + o for p, o in zip(prompts, outputs, strict=True)],
    )
