"""Every prefill-attention launch of a speculative run matches a variant the runner compiles at start-up
(kernels.warm_up_prefill_attention), so no eager step (a chunked prefill, a verify, a drafter
catch-up) stops to compile one while serving. Checked on the Triton kernels (interpreted on CPU) by
the key Triton compiles by: the constexprs and launch options, and for every other argument what
Triton specialises on (an int equal to 1 or divisible by 16, a pointer's dtype and 16-byte
alignment), the arguments the kernel declares unspecialised left out."""

import torch

from tpfuse import knobs
from tpfuse.config import EngineConfig
from tpfuse.engine.llm import LLM
from tpfuse.kernels import decode_merge, prefill_attention

from .spec_helpers import ENGINE, PROMPTS, greedy, spec_config, write_eagle3_head


def _specialisation(value):
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__
    return "one" if value == 1 else "multiple of 16" if value % 16 == 0 else "int"


class RecordingKernel:
    """Stands in for the Triton kernel: records each launch's compile key, then launches it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())
        self.keys = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = zip(self.kernel.arg_names, args, strict=False)
            specialised = tuple((n, _specialisation(a)) for n, a in named if n not in self.unspecialised)
            self.keys.add((tuple(sorted(kwargs.items())), specialised))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_a_speculative_run_launches_only_prefill_variants_compiled_at_start_up(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    recorder = RecordingKernel(prefill_attention._prefill_kernel)
    merges = RecordingKernel(decode_merge._decode_merge_kernel)  # the key-split partials' merge
    monkeypatch.setattr(prefill_attention, "_prefill_kernel", recorder)
    monkeypatch.setattr(decode_merge, "_decode_merge_kernel", merges)
    path = write_eagle3_head(str(tmp_path))
    config = EngineConfig(
        **ENGINE, enable_prefix_caching=False, speculative=spec_config("eagle3", path, adaptive=True)
    )
    llm = LLM(config=config)
    engine = llm.engine
    # what the runner compiles on CUDA (on CPU nothing compiles, so the warm-up is called here)
    recorder.keys.clear()
    merges.keys.clear()
    num_heads = engine.executor.model.layers[0].self_attn.num_heads
    prefill_attention.compile_prefill_variants(
        *engine.executor.kv_caches[0], num_heads, config.max_num_batched_tokens, tree=False
    )
    compiled, recorder.keys = recorder.keys, set()
    merges_compiled, merges.keys = merges.keys, set()
    # chunked prefills next to decodes, plain steps, a catch-up, then drafting at k = 3 and k = 1
    choices = iter([0] * 12 + [3] * 6 + [0] * 9 + [1] * 1000)
    engine.spec_decoder.policy.choose = lambda num_decode: next(choices)
    llm.generate(PROMPTS, greedy(40))
    assert engine.spec_decoder.stats.num_drafts > 0
    assert recorder.keys, "the run launched prefill attention"
    assert recorder.keys <= compiled, f"launched but not compiled ahead: {recorder.keys - compiled}"
    assert merges.keys and merges.keys <= merges_compiled, merges.keys - merges_compiled
