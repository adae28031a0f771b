"""How many KV blocks a CPU engine allocates: one sequence of the model's whole length where memory
allows (so a model served on a CPU keeps its context), never fewer than the fixed floor."""

from tpfuse.engine import kv_cache
from tpfuse.engine.llm import LLM

GIB = 2**30


def test_a_cpu_engine_holds_one_whole_length_sequence_within_its_share_of_memory():
    block = 1 << 20  # 1 MiB a block: the floor holds 64
    assert kv_cache.cpu_kv_blocks(block, longest_blocks=10, available_bytes=16 * GIB) == 64
    assert kv_cache.cpu_kv_blocks(block, longest_blocks=1000, available_bytes=16 * GIB) == 1000
    # 1/8 of 4 GiB is 512 blocks: the whole length (1000) does not fit, the share does
    assert kv_cache.cpu_kv_blocks(block, longest_blocks=1000, available_bytes=4 * GIB) == 512
    assert kv_cache.cpu_kv_blocks(block, longest_blocks=1000, available_bytes=0) == 64
    assert kv_cache.available_memory_bytes() > 0


def test_a_long_context_model_keeps_its_whole_length_on_a_cpu(tmp_path):
    from tests.engine.checkpoints import save_byte_tokenizer
    from tests.model.harness import build_hf_checkpoint

    # 2 layers x 8 KV heads x 64 dims x K and V x 4 bytes = 8 KiB a token: 32768 positions are 256 MiB,
    # past the 64 MiB floor (8192 tokens)
    build_hf_checkpoint(
        tmp_path, "llama", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
        hidden_size=512, max_position_embeddings=32768,
    )  # fmt: skip
    save_byte_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_running_requests=2)
    try:
        assert llm.engine.max_model_len == 32768
        assert llm.engine.stats().num_kv_blocks * llm.engine.config.block_size >= 32768
    finally:
        llm.shutdown()
