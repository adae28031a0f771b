"""OpenAI response shapes: object names, roles, finish reasons and usage where clients expect them."""

from tpfuse.server import responses


def test_streamed_chat_chunks_carry_the_role_first_and_usage_last():
    first = responses.chunk("chat", "id", 1, "tiny", "a", None, first=True)
    later = responses.chunk("chat", "id", 1, "tiny", "b", "stop")
    last = responses.usage_chunk("chat", "id", 1, "tiny", responses.usage(3, 2))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert later["choices"][0] == {
        "index": 0,
        "delta": {"content": "b"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5
    assert {first["object"], later["object"], last["object"]} == {"chat.completion.chunk"}


def test_full_responses_have_openai_object_names_and_usage():
    chat = responses.full_response("chat", "id", 1, "tiny", "hi", "length", responses.usage(4, 2))
    text = responses.full_response("completion", "id", 1, "tiny", "hi", "stop", responses.usage(4, 2))
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hi",
    }
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hi"
    assert text["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
