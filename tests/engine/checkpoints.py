"""Tiny Hugging Face checkpoints with a byte-level tokenizer, for end-to-end engine tests.

The model weights come from tests/model/harness.py (random, every tensor non-trivial); the vocabulary
is 256 byte tokens + <s> + </s> + one unused id: 259, divisible by neither 2 nor 4.
"""

from __future__ import annotations

from tests.model.harness import build_hf_checkpoint

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
BOS, EOS, VOCAB = 256, 257, 259


def save_byte_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    assert (fast.bos_token_id, fast.eos_token_id) == (BOS, EOS)
    fast.save_pretrained(directory)


def build_checkpoint(directory, kind: str, seed: int = 0):
    """Saves a random float32 transformers model of architecture kind plus a tokenizer to directory;
    returns the transformers model."""
    model = build_hf_checkpoint(
        directory, kind, seed=seed, vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS
    )
    save_byte_tokenizer(directory)
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate; stops at EOS like the engine does."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    return out[0, len(prompt_ids) :].tolist()
