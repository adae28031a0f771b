"""Speculative decoding: drafters (EAGLE-3, MTP, n-gram, draft model), lossless verification, adaptive k.

Modules
  drafter.py        Drafter.propose(DraftInputs, num_draft_tokens) -> DraftProposal: the one seam;
                    TreeDrafter.propose_tree (EAGLE-3) adds draft trees
  eagle3.py         Eagle3Config (public LlamaForCausalLMEagle3 config), Eagle3Head (module)
  eagle3_checkpoint.py  load_eagle3_head (.safetensors / pytorch_model.bin), save_random_eagle3_head
  eagle3_drafter.py Eagle3Drafter, eagle3_chain_draft, target_embedding(model)
  mtp.py            MtpHead, MtpDrafter (DeepSeek-V3's MTP layer through the EAGLE-3 chain)
  draft_model.py    DraftModelDrafter over any model with the LlamaForCausalLM seam
  ngram.py          NgramDrafter, propose_ngram (prompt lookup)
  verify.py         greedy_verify, rejection_sample_verify, seeded_sample_verify -> VerifyResult
  simulate.py       benchmark-only simulated acceptance (--speculative-simulate-acceptance-length)
  adaptive.py       AdaptivePolicy: k per step from batch bucket costs and acceptance estimates
  acceptance.py     AcceptanceEstimate: decayed per-position acceptance rates, E[accepted | k]
  paged.py          AttentionMetadata for a drafter's passes; seeded_random.py, draft_sampling.py

How the engine drives a speculative decode step (tests/spec/spec_loop.py is a working miniature;
the engine's implementation is tpfuse/engine/spec_*.py: there step 6's inputs are the positions each
sequence's drafter lags behind on, read with EAGLE-3 features from a store paged like the KV cache,
and seeded requests are verified by seeded_sample_verify so their tokens do not depend on k)
  1. k = policy.choose(decode_batch_size) (0..K; prefills are not counted in the batch size).
  2. proposal = drafter.propose(inputs_from_last_step, k): [B, k] drafts, per-row counts, q or None.
  3. Verify pass: each sequence's newest token + its k drafts at positions L..L+k through the
     model's forward (prefill attention over the paged cache; blocks reserved up to L+k), logits
     [B, k+1, V]; with EAGLE-3 the forward also returns aux features (aux_hidden_state_layers =
     head.config.capture_layers(N)), captured at k = 0 too.
  4. Rank 0 verifies (greedy_verify for temperature 0, rejection_sample_verify otherwise, or
     simulate_acceptance in the benchmark mode) and broadcasts (num_accepted, token_ids).
  5. Rollback is the length: num_computed += num_accepted + 1; KV at rejected positions lies past
     it and is overwritten by the next pass. Drafters' caches need no rollback either.
  6. Next DraftInputs: only the accepted positions L..L+a (tokens, next tokens, their aux rows).
  7. policy.record_step(batch, k, seconds of the whole step) and policy.record_acceptance(...).
"""
