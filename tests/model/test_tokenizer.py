"""Tokenizers: the byte-level one of the presets and the Hugging Face wrapper for checkpoints."""

from __future__ import annotations

import json

import pytest

from tpfuse.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]


def test_byte_tokenizer_round_trips_multibyte_utf8():
    tok = ByteTokenizer()
    text = "héllo, 世界 🚀\n"
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_ids_are_utf8_bytes_after_bos():
    tok = ByteTokenizer()
    assert tok.encode("é") == [tok.bos_token_id, 0xC3, 0xA9]


def test_byte_tokenizer_adds_bos_only_once():
    tok = ByteTokenizer()
    assert tok.encode("<|bos|>ab") == [tok.bos_token_id, ord("a"), ord("b")]


def test_special_token_strings_encode_to_single_ids_and_decode_to_nothing():
    tok = ByteTokenizer()
    ids = tok.encode("a<|user|>b<|end|>")
    assert ids == [
        tok.bos_token_id,
        ord("a"),
        tok.special_ids["<|user|>"],
        ord("b"),
        tok.special_ids["<|end|>"],
    ]
    assert tok.decode(ids) == "ab"


def test_partial_utf8_sequence_decodes_to_replacement_char_until_completed():
    tok = ByteTokenizer()
    rocket = list("🚀".encode())
    assert tok.decode(rocket[:2]) == "\ufffd"
    assert tok.decode(rocket) == "🚀"


def test_ids_past_the_byte_vocabulary_decode_to_visible_placeholder_letters():
    tok = ByteTokenizer()
    text = tok.decode([128000, 128001, 5000])
    assert len(text) == 3 and text.isalpha()


def test_byte_chat_template_marks_roles_and_ends_with_the_assistant_turn():
    tok = ByteTokenizer()
    prompt = tok.apply_chat_template(CHAT)
    assert prompt == "<|system|>Be brief.<|end|><|user|>Hi ✓<|end|><|assistant|>"
    assert tok.encode(prompt)[-1] == tok.special_ids["<|assistant|>"]


def test_end_of_turn_marker_is_an_eos_token():
    tok = ByteTokenizer()
    assert tok.special_ids["<|end|>"] in tok.eos_token_ids and tok.special_ids["<|eos|>"] in tok.eos_token_ids


def test_presets_get_the_byte_tokenizer():
    assert isinstance(load_tokenizer("llama-3.1-8b"), ByteTokenizer)


def test_unknown_model_name_is_rejected_with_the_presets_listed():
    with pytest.raises(ValueError, match=r"neither a local directory nor a preset \(tiny"):
        load_tokenizer("not-a-model")


def save_hf_tokenizer(directory, chat_template: str | None) -> None:
    """A small byte-level BPE tokenizer trained offline, saved like a checkpoint's tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(["hello world, the quick brown fox", "Be brief. Hi there"] * 10, trainer)
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(directory)


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf-tokenizer")
    save_hf_tokenizer(directory, TEMPLATE)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    return directory


def test_hf_tokenizer_round_trips_text_and_drops_special_tokens(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("hello wörld 🚀")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "hello wörld 🚀"


def test_hf_tokenizer_does_not_double_the_bos_a_chat_template_wrote(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    ids = tok.encode(tok.apply_chat_template(CHAT))
    assert ids.count(tok.bos_token_id) == 1


def test_hf_tokenizer_uses_the_checkpoint_chat_template(hf_dir):
    prompt = load_tokenizer(str(hf_dir)).apply_chat_template(CHAT)
    assert prompt == "<s>[system] Be brief.\n[user] Hi ✓\n[assistant] "


def test_hf_tokenizer_without_template_falls_back_to_a_plain_one(tmp_path):
    save_hf_tokenizer(tmp_path, None)
    prompt = load_tokenizer(str(tmp_path)).apply_chat_template(CHAT)
    assert prompt == "System: Be brief.\nUser: Hi ✓\nAssistant:"


def test_hf_eos_ids_include_tokenizer_and_generation_config_ids(hf_dir):
    assert load_tokenizer(str(hf_dir)).eos_token_ids == {1, 7}


def test_directory_without_tokenizer_files_says_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer files \(tokenizer\.json, .*\) in "):
        load_tokenizer(str(tmp_path))


def test_both_tokenizers_survive_pickling_for_the_server_process(hf_dir):
    import pickle

    for tok in (ByteTokenizer(), load_tokenizer(str(hf_dir))):
        clone = pickle.loads(pickle.dumps(tok))
        assert clone.encode("hello ✓") == tok.encode("hello ✓")
