"""Stop strings (as transformers' `stop_strings`): a row stops once the decoded text of its committed tokens contains
one of them (docs/architecture.md, "Serving"). Checked on the host between steps, decoding only the newly committed
tail and, before it, enough tokens to hold the longest stop string."""

from __future__ import annotations


class StopStrings:
    def __init__(self, strings: str | tuple[str, ...] | list[str], tokenizer):
        strings = (strings,) if isinstance(strings, str) else strings
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError("stop_strings need the tokenizer that made the prompt: pass tokenizer=... (an object with "
                             "decode(ids)), as transformers' generate does.")
        if not isinstance(strings, (tuple, list)) or not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings={strings!r}: pass a string or a list of non-empty strings.")
        self.strings, self.tokenizer = tuple(strings), tokenizer
        # tokens before the new ones that may start a match: a token holds at least one byte of text (byte-level
        # tokenizers split a character over several tokens), so a match spans at most as many tokens as it has bytes
        self.window = max(len(s.encode("utf-8")) for s in self.strings)

    def find(self, tokens: list[int], checked: int) -> int | None:
        """How many of the committed `tokens` run through the first one completing a stop string, looking only at
        matches that end after the first `checked` (already searched) tokens; None: no stop string yet. A match
        ending in the new tokens starts within `window` tokens before them."""
        start = max(0, checked - self.window)
        if not self._holds(tokens[start:]):
            return None
        for end in range(max(checked, start) + 1, len(tokens) + 1):
            if self._holds(tokens[start:end]):
                return end
        return len(tokens)

    def _holds(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return any(s in text for s in self.strings)
