import json

import pytest

from tpfuse.bench.prompt_set import BUILTIN_PROMPTS
from tpfuse.bench.prompts import PromptConfig, load_prompts, read_sharegpt


def test_random_prompts_are_token_ids_of_the_requested_length_and_seeded():
    config = PromptConfig("random", input_len=33, seed=7)
    first = load_prompts(config, 4)
    assert all(len(p) == 33 and all(isinstance(t, int) and 0 <= t < 256 for t in p) for p in first)
    assert load_prompts(config, 4) == first
    assert load_prompts(PromptConfig("random", input_len=33, seed=8), 4) != first


def test_random_prompts_stay_inside_the_tokenizer_vocabulary(word_tokenizer):
    prompts = load_prompts(PromptConfig("random", input_len=50), 3, tokenizer=word_tokenizer)
    assert max(max(p) for p in prompts) < word_tokenizer.vocab_size


def test_random_prompts_for_chat_are_text():
    prompts = load_prompts(PromptConfig("random", input_len=5), 2, token_ids_ok=False)
    assert all(isinstance(p, str) and len(p.split()) == 5 for p in prompts)


def test_builtin_prompts_cycle_when_more_are_needed():
    prompts = load_prompts(PromptConfig("builtin"), len(BUILTIN_PROMPTS) + 3)
    assert set(prompts) == set(BUILTIN_PROMPTS)
    assert prompts[:3] == prompts[len(BUILTIN_PROMPTS) :]


def test_sharegpt_file_gives_first_human_turns(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "first?"}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"from": "gpt", "value": "no human"}]},
        {"conversations": [{"from": "human", "value": "second?"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    assert read_sharegpt(path) == ["first?", "second?"]
    config = PromptConfig("sharegpt", dataset_path=str(path))
    assert sorted(set(load_prompts(config, 4))) == ["first?", "second?"]


@pytest.mark.parametrize(
    "content, message", [(None, "does not exist"), ("{not json", "not valid JSON"), ("[]", "no conversation")]
)
def test_bad_sharegpt_files_are_refused_with_the_reason(tmp_path, content, message):
    path = tmp_path / "sg.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_sharegpt(path)


def test_sharegpt_without_a_path_is_refused():
    with pytest.raises(ValueError, match="--dataset-path"):
        PromptConfig("sharegpt")
