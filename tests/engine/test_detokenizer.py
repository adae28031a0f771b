"""Detokenizer: incremental text, partial UTF-8 characters, stop strings."""

import random

from tpfuse.engine.detokenizer import Detokenizer


class Utf8Bytes:
    """Ids are bytes; incomplete characters decode to U+FFFD, as the byte tokenizer does."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def ids_of(text):
    return list(text.encode("utf-8"))


def stream(detok, ids, chunk=1):
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces


def test_concatenated_deltas_equal_the_decoded_text():
    text = "héllo wörld, ünïcödé 🙂 done"
    detok = Detokenizer(Utf8Bytes())
    pieces = stream(detok, ids_of(text))
    pieces.append(detok.flush())
    assert "".join(pieces) == text == detok.text


def test_a_character_split_across_tokens_is_released_whole():
    detok = Detokenizer(Utf8Bytes())
    emoji = ids_of("🙂")
    assert [detok.add([b]) for b in emoji] == ["", "", "", "🙂"]


def test_random_chunking_never_releases_a_replacement_character():
    text = "日本語のテキスト and ascii 🙂🙃 mixed"
    rng = random.Random(0)
    ids = ids_of(text)
    detok = Detokenizer(Utf8Bytes())
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        assert "\ufffd" not in detok.add(ids[i : i + n])
        i += n
    detok.flush()
    assert detok.text == text


def test_text_is_cut_before_a_stop_string_and_stopped_is_set():
    detok = Detokenizer(Utf8Bytes(), stop=["STOP"])
    pieces = stream(detok, ids_of("abc STOP def"))
    assert "".join(pieces) == "abc " == detok.text
    assert detok.stopped
    assert detok.add(ids_of("more")) == "" and detok.flush() == ""


def test_a_stop_string_spanning_tokens_is_found_and_never_partly_released():
    detok = Detokenizer(Utf8Bytes(), stop=["</end>"])
    released = ""
    for piece in stream(detok, ids_of("value </end"), chunk=3):
        released += piece
        assert "</" not in released
    assert not detok.stopped
    released += detok.add(ids_of(">tail"))
    assert detok.stopped and released == "value "


def test_the_earliest_of_several_stop_strings_wins():
    detok = Detokenizer(Utf8Bytes(), stop=["xyz", "b"])
    stream(detok, ids_of("a b xyz"), chunk=7)
    assert detok.text == "a "


def test_held_back_text_comes_out_on_flush_when_no_stop_string_matches():
    detok = Detokenizer(Utf8Bytes(), stop=["never"])
    released = "".join(stream(detok, ids_of("abcnev")))
    assert released == "ab"
    assert detok.flush() == "cnev"
    assert detok.text == "abcnev" and not detok.stopped


def test_flush_releases_an_unfinished_character_as_replacement():
    detok = Detokenizer(Utf8Bytes())
    assert detok.add(ids_of("ok")) == "ok"
    assert detok.add(ids_of("🙂")[:2]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok\ufffd"
