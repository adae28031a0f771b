"""Request validation without a server: every bad field is a RequestError naming it."""

import pytest

from tpfuse.server import protocol
from tpfuse.server.protocol import RequestError, parse_chat_request, parse_completion_request

MODELS = ["tiny"]


def _completion(**fields):
    return parse_completion_request({"model": "tiny", "prompt": "hi", **fields}, MODELS)


def _chat(**fields):
    return parse_chat_request(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}, MODELS
    )


def _param_of_error(fn, **fields) -> str | None:
    with pytest.raises(RequestError) as info:
        fn(**fields)
    assert info.value.status == 400
    return info.value.param


def test_completion_request_carries_every_sampling_field():
    req = _completion(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop="x", min_tokens=2, ignore_eos=True,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    assert (req.prompt, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (
        "hi",
        7,
        0.5,
        0.9,
        5,
        3,
    )
    assert (req.stop, req.min_tokens, req.ignore_eos, req.stream, req.include_usage) == (
        ["x"],
        2,
        True,
        True,
        True,
    )


def test_completion_prompt_may_be_token_ids_or_a_one_element_list():
    assert _completion(prompt=[5, 6, 7]).prompt_token_ids == [5, 6, 7]
    assert _completion(prompt=["text"]).prompt == "text"
    assert _completion(prompt=[[1, 2]]).prompt_token_ids == [1, 2]


def test_top_k_zero_means_off():
    assert _completion(top_k=0).top_k == -1


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stream": 1}, "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats"),
        ({"n": 17}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"model": "gpt-4"}, "model"),
        ({"model": 7}, "model"),
    ],
)
def test_bad_completion_field_is_named(fields, param):
    assert _param_of_error(_completion, **fields) == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_bad_chat_field_is_named(fields, param):
    assert _param_of_error(_chat, **fields) == param


def test_body_that_is_not_an_object_is_refused():
    with pytest.raises(RequestError, match="JSON object"):
        parse_completion_request([1, 2], MODELS)


def test_chat_content_parts_are_joined_and_max_tokens_defaults_to_the_rest_of_the_context():
    req = _chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert protocol.sampling_params_for(req, num_prompt_tokens=10, max_model_len=64).max_tokens == 54


def test_prompt_that_fills_the_context_is_refused_naming_the_prompt():
    with pytest.raises(RequestError) as info:
        protocol.sampling_params_for(_completion(), num_prompt_tokens=64, max_model_len=64)
    assert info.value.param == "prompt" and "64" in info.value.message


def test_max_tokens_beyond_the_context_is_refused_naming_the_limit():
    with pytest.raises(RequestError) as info:
        protocol.sampling_params_for(_completion(max_tokens=60), num_prompt_tokens=10, max_model_len=64)
    assert info.value.param == "max_tokens" and "54" in info.value.message


def test_sampling_params_carry_the_request_fields():
    req = _completion(max_tokens=5, temperature=0, top_k=3, seed=9, stop=["z"], min_tokens=1, ignore_eos=True)
    params = protocol.sampling_params_for(req, num_prompt_tokens=4, max_model_len=64)
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (5, 0.0, 3, 9)
    assert (params.stop, params.min_tokens, params.ignore_eos) == (["z"], 1, True)


def test_null_fields_mean_their_defaults():
    req = _completion(n=None, temperature=None, stop=None, seed=None, max_tokens=None, stream_options=None)
    assert (req.n, req.temperature, req.stop, req.seed, req.max_tokens) == (1, 1.0, [], None, 16)
