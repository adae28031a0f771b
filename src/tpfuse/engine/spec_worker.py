"""One rank's speculative machinery: the drafter's weights and paged KV, and the feature store.

Every rank runs the same drafter passes on the same packed inputs, so drafts agree across ranks
without being sent (the EAGLE-3 head is replicated and reads all-reduced embeddings; a draft model and
the MTP layer are sharded like the target). The n-gram drafter runs on rank 0's host only.

The feature store ([num_blocks * block_size + 1, H_head], EAGLE-3 and MTP) holds fc(target features)
(MTP: the target's final hidden states as they are) at every KV slot the target computed, written by
every target forward (eager or graph); the drafter reads the positions it has not consumed yet
through their slots on a later step. The extra last row takes the writes of padding tokens (slot -1).

SpecWorker is the plain runner's hook (engine/runner_hook.py): the runner sizes, allocates and
captures it without knowing what it is (verify graphs are its extra query rows, the window drafter
fills them inside the graph, write_features is its after_forward). speculative_hook(config) is what
the executors pass to ModelRunner, and worker_of(runner) is how the speculative side finds it again.
"""

from __future__ import annotations

from functools import partial

import torch

from tpfuse.config import EngineConfig
from tpfuse.engine import kv_cache
from tpfuse.engine.spec_inputs import SpecInputs
from tpfuse.engine.step_inputs import StepInputs
from tpfuse.model.config import ModelConfig
from tpfuse.spec.drafter import Drafter, DraftInputs, DraftProposal
from tpfuse.spec.tree import DraftTree, check_tree_settings, num_lookahead_tokens


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def speculative_hook(config: EngineConfig):
    """The ModelRunner hook factory of config (runner_hook.HookFactory): a SpecWorker per runner when
    speculative decoding is on, else None (a plain runner)."""
    return partial(SpecWorker, config) if config.speculative.enabled else None


def worker_of(runner) -> SpecWorker:
    """runner's SpecWorker. Raises ValueError when the runner was built without one."""
    hook = runner.hook
    if not isinstance(hook, SpecWorker):
        raise ValueError(
            "this ModelRunner has no speculative worker: build it with "
            "ModelRunner(config, hook=speculative_hook(config)) and speculative decoding on"
        )
    return hook


class SpecWorker:
    """Builds the drafter of config.speculative for this rank's target model.

    Raises ValueError when the drafter cannot serve this target (missing path, vocabulary or hidden
    size mismatch, EAGLE-3 layer ids the target does not have). Call allocate() once the number of
    KV blocks is known (bytes_per_block() tells the sizing how much the drafter adds per block).
    """

    def __init__(self, config: EngineConfig, model, model_config: ModelConfig, parallel, device):
        spec = config.speculative
        self.algorithm = spec.algorithm
        self.max_num_draft_tokens = spec.num_steps
        self.device = torch.device(device)
        self.head = None
        self.draft_model = None
        self.draft_config: ModelConfig | None = None
        self.target_vocab_size = model_config.vocab_size
        self.drafter: Drafter | None = None  # a TreeDrafter when tree drafting
        self.window_drafter = None  # EAGLE-3 chain drafting with static shapes (graph-safe), else None
        self.features: torch.Tensor | None = None
        self.tree_topk = spec.eagle_topk if spec.eagle_topk > 1 else None
        self.num_tree_nodes = spec.num_draft_tokens
        self.lookahead = num_lookahead_tokens(spec)
        if self.tree_topk is not None:
            if self.algorithm != "eagle3":
                raise ValueError(
                    f"--speculative-eagle-topk {spec.eagle_topk}: tree drafting needs "
                    f"--speculative-algorithm eagle3 (got {self.algorithm}); use --speculative-eagle-topk 1"
                )
            if model_config.mla is not None:
                raise ValueError(
                    f"--speculative-eagle-topk {spec.eagle_topk}: tree drafting is not implemented for "
                    f"latent attention ({model_config.architecture}); use --speculative-eagle-topk 1"
                )
            check_tree_settings(spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)
        if self.algorithm in ("eagle3", "draft") and not spec.draft_model_path:
            raise ValueError(
                f"--speculative-algorithm {self.algorithm} needs --speculative-draft-model-path "
                "(an EAGLE-3 head directory, or a draft model directory or preset)"
            )
        if self.algorithm == "eagle3":
            self._load_eagle3(spec.draft_model_path, model, model_config)
        elif self.algorithm == "mtp":
            self._load_mtp(config, model, model_config, parallel)
        elif self.algorithm == "draft":
            self._load_draft_model(config, model_config, parallel)

    def _load_eagle3(self, path: str, model, model_config: ModelConfig) -> None:
        from tpfuse.spec.eagle3_checkpoint import load_eagle3_head

        self.head = load_eagle3_head(path, model_config, self.device)
        layers = self.head.config.capture_layers(model_config.num_layers)
        if list(layers) != sorted(set(layers)):
            raise ValueError(
                f"the EAGLE-3 head {path} reads target layers {list(layers)} (the default for a "
                f"{model_config.num_layers}-layer target); they must be distinct and increasing: set "
                "eagle_config.eagle_aux_hidden_state_layer_ids in its config.json"
            )
        model.aux_hidden_state_layers = tuple(layers)
        self.target_model = model

    def _load_mtp(self, config: EngineConfig, model, model_config: ModelConfig, parallel) -> None:
        from tpfuse.model.deepseek_v3_mtp import load_mtp_module
        from tpfuse.spec.mtp import MtpHead

        if config.speculative.draft_model_path:
            raise ValueError(
                "--speculative-algorithm mtp reads the MTP layer from --model's checkpoint; leave "
                "--speculative-draft-model-path out"
            )
        module = load_mtp_module(config, model, model_config, parallel, self.device)
        self.head = MtpHead(module, model.cos_sin_cache, model_config.vocab_size)
        model.aux_final_hidden = True
        self.target_model = model

    def _load_draft_model(self, config: EngineConfig, target: ModelConfig, parallel) -> None:
        from tpfuse.model.loader import load_model

        path = config.speculative.draft_model_path
        draft_engine_config = EngineConfig(
            model=path,
            device=self.device.type,
            dtype=_dtype_name(target.dtype),
            load_format=config.load_format,
            seed=config.seed,
            tp_size=config.tp_size,
        )
        self.draft_model, self.draft_config = load_model(draft_engine_config, parallel, self.device)
        if self.draft_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {path} has vocab_size {self.draft_config.vocab_size} but the target has "
                f"{target.vocab_size}; a draft model must share the target's tokenizer and vocabulary"
            )

    @property
    def host_drafts(self) -> bool:
        """Drafts are proposed on rank 0's host and packed (n-gram)."""
        return self.algorithm == "ngram"

    @property
    def max_positions(self) -> int:
        """Positions the drafter's rotary cache covers (unbounded for n-gram)."""
        if self.head is not None:
            return self.head.cos_sin_cache.shape[0]
        if self.draft_config is not None:
            return self.draft_config.max_position_embeddings
        return 1 << 62

    @property
    def position_margin(self) -> int:
        """Positions past max_model_len that drafts may occupy (the sizing keeps them in range)."""
        return self.lookahead + 1

    @property
    def max_extra_query_rows(self) -> int:
        """Verify graphs are captured for every k in 1..num_steps (k drafts after the newest token)."""
        return self.max_num_draft_tokens

    @property
    def fills_extra_rows(self) -> bool:
        """The window drafter drafts inside the verify graphs (EAGLE-3 chains; known after allocate)."""
        return self.window_drafter is not None

    @property
    def tree_attention(self) -> bool:
        return self.tree_topk is not None

    def models(self) -> list[torch.nn.Module]:
        """The drafter's modules, routed by the start-up projection timing with the target's."""
        return [m for m in (self.draft_model, self.head) if m is not None]

    def bytes_per_block(self, tp_size: int, block_size: int) -> int:
        """Drafter KV plus feature store for one KV block on this rank."""
        if self.algorithm == "mtp":
            elem = torch.empty((), dtype=self.head.dtype).element_size()
            row = self.head.kv_cache_shape(1, 1)[-1]
            return block_size * elem * (row + self.head.feature_size)
        if self.head is not None:
            c = self.head.config
            elem = torch.empty((), dtype=c.dtype).element_size()
            return block_size * elem * (2 * c.num_kv_heads * c.head_dim + c.hidden_size)
        if self.draft_model is not None:
            return kv_cache.bytes_per_block(self.draft_config, tp_size, block_size)
        return 0

    def allocate(
        self, num_blocks: int, block_size: int, tp_size: int, max_rows: int = 1, max_seq_len: int = 1
    ) -> None:
        """Allocates the drafter's KV (indexed by the target's block tables) and builds the drafter.
        max_rows, max_seq_len: the most rows of a window step and a bound of any position + 1 (the
        EAGLE-3 window drafter's static buffers and launch sizes)."""
        if self.algorithm == "mtp":
            from tpfuse.spec.mtp import MtpDrafter

            shape = self.head.kv_cache_shape(num_blocks, block_size)
            kv = (torch.zeros(shape, dtype=self.head.dtype, device=self.device),)
            rows = num_blocks * block_size + 1
            width, dtype = self.head.feature_size, self.head.dtype
            self.features = torch.zeros(rows, width, dtype=dtype, device=self.device)
            self.drafter = MtpDrafter(self.head, kv, self.target_vocab_size)
        elif self.head is not None:
            from tpfuse.spec.eagle3_drafter import Eagle3Drafter, target_embedding
            from tpfuse.spec.eagle3_window import Eagle3WindowDrafter

            c = self.head.config
            shape = self.head.kv_cache_shape(num_blocks, block_size)
            kv = tuple(torch.zeros(shape, dtype=c.dtype, device=self.device) for _ in range(2))
            rows = num_blocks * block_size + 1
            self.features = torch.zeros(rows, c.hidden_size, dtype=c.dtype, device=self.device)
            self.drafter = Eagle3Drafter(
                self.head, target_embedding(self.target_model), kv, self.target_vocab_size
            )
            if self.tree_topk is None:
                self.window_drafter = Eagle3WindowDrafter(
                    self.head, self.drafter.embed_tokens, kv, self.features, block_size, max_rows,
                    self.max_num_draft_tokens, max_seq_len,
                )  # fmt: skip
        elif self.draft_model is not None:
            from tpfuse.spec.draft_model import DraftModelDrafter

            caches = kv_cache.allocate_kv_caches(
                self.draft_config, tp_size, num_blocks, block_size, self.device
            )
            self.drafter = DraftModelDrafter(self.draft_model, caches, self.target_vocab_size)

    def fill_extra_rows(
        self, num_rows: int, num_draft_tokens: int, block_tables: torch.Tensor
    ) -> torch.Tensor:
        """Inside a verify graph: the window drafter's [num_rows, k] drafts (its window loaded before)."""
        return self.window_drafter.draft(num_rows, num_draft_tokens, block_tables)

    def after_forward(self, aux: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Every target forward, plain steps too (the drafter catches up on them later)."""
        self.write_features(aux, slot_mapping)

    def write_features(self, aux: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Stores fc(aux) [T, H_head] at slot_mapping [T] (slot < 0: the spare row). Graph-safe."""
        if self.features is None or aux is None:
            return
        spare = self.features.shape[0] - 1
        index = torch.where(slot_mapping < 0, spare, slot_mapping)
        self.features.index_copy_(0, index, self.head.combine_features(aux))

    def apply_kv_moves(self, spec: SpecInputs, kv_caches) -> None:
        """Copies the KV of slots spec.kv_move_src to kv_move_dst in every target layer's cache (and
        the EAGLE-3 feature rows): the previous tree step's accepted path, moved to its positions."""
        if spec.header.num_kv_moves == 0:
            return
        src, dst = spec.kv_move_src, spec.kv_move_dst
        for cache in (c for pair in kv_caches for c in pair):
            flat = cache.view(-1, *cache.shape[2:])
            flat[dst] = flat[src]  # the right side is gathered first: overlapping pairs are safe
        if self.features is not None:
            self.features[dst] = self.features[src]

    def propose(
        self, step: StepInputs, spec: SpecInputs, block_size: int
    ) -> DraftProposal | DraftTree | None:
        """Every rank: extends the drafter over the drafter rows and proposes k drafts; returns the
        verify rows' proposal ([D, k] ids, [D] counts, [D, k, V] probs or None), or their DraftTree
        ([D, k + 1] nodes) in tree steps; None without a device drafter or drafter rows."""
        h = spec.header
        if self.drafter is None or h.num_drafter_rows == 0:
            return None
        rows = spec.decode_drafter_index
        temperatures = seeds = None
        if h.sampled_drafts:  # seeded rows draft by argmax: seeded_sample_verify matches exact tokens
            temperatures = torch.zeros(h.num_drafter_rows, device=self.device)
            temperatures[rows] = torch.where(spec.seeded.bool(), 0.0, spec.temperatures)
            seeds = torch.zeros(h.num_drafter_rows, dtype=torch.int64, device=self.device)
            seeds[rows] = spec.seeds
        inputs = DraftInputs(
            input_ids=spec.ext_input_ids,
            positions=spec.ext_positions,
            next_token_ids=spec.ext_next_ids,
            query_start_loc=spec.ext_query_start_loc.to(torch.int32),
            block_tables=step.block_tables.index_select(0, spec.drafter_rows).to(torch.int32),
            block_size=block_size,
            hidden_states=self.features.index_select(0, spec.ext_slots)
            if self.features is not None
            else None,
            temperatures=temperatures,
            seeds=seeds,
            max_query_len=h.ext_max_query_len,
            max_seq_len=h.ext_max_seq_len,
        )
        k = h.num_draft_tokens if h.num_decode else 0
        if h.tree and k > 0:
            tree = self.drafter.propose_tree(inputs, self.max_num_draft_tokens, self.tree_topk, k + 1)
            return DraftTree(*(x.index_select(0, rows) for x in (tree.token_ids, tree.parents, tree.depths)))
        proposal = self.drafter.propose(inputs, k)
        if not h.num_decode:
            return None
        return DraftProposal(
            proposal.token_ids.index_select(0, rows),
            torch.minimum(proposal.num_draft_tokens.index_select(0, rows), spec.num_drafts),
            proposal.probs.index_select(0, rows) if proposal.probs is not None else None,
        )
