"""Stop strings found from the decoded tail of the committed tokens equal those found in the whole text."""

import pytest

from hf_blockdiff.generation.stop_strings import StopStrings


class ByteTokenizer:
    """Byte-level ids (a character of several UTF-8 bytes spans several tokens), decoded as byte-level BPE does."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


class SpaceDroppingTokenizer:
    """Words with a leading space each, whose decoded text drops its first space (as SentencePiece decoders do)."""

    WORDS = [" a", " b", " end", "!"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.WORDS[i] for i in ids).removeprefix(" ")


def first_stop(stops: StopStrings, tokens: list[int]) -> int | None:
    """Commit `tokens` one at a time, checking each step's new token as a row does."""
    for checked in range(len(tokens)):
        found = stops.find(tokens[:checked + 1], checked)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("stop", ["éé", "!é", "日本", "é"])
def test_a_stop_string_of_multibyte_characters_spread_over_byte_tokens(stop):
    """Four bytes of "éé" are two characters: a window counted in characters missed the match."""
    text = "xy" + stop + "z"
    tokens = list(text.encode("utf-8"))
    ends = len(("xy" + stop).encode("utf-8"))
    assert first_stop(StopStrings([stop], ByteTokenizer()), tokens) == ends


def test_a_dropped_leading_space_at_the_window_start_misses_nothing():
    tokenizer = SpaceDroppingTokenizer()
    tokens = [0, 0, 0, 1, 2, 3, 0]  # " a a a b end! a"
    assert first_stop(StopStrings([" end"], tokenizer), tokens) == 5
    assert first_stop(StopStrings([" b end!"], tokenizer), tokens) == 6
    assert first_stop(StopStrings(["zz"], tokenizer), tokens) is None
