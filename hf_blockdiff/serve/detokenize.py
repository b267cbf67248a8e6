"""Committed tokens to text, a piece at a time (docs/architecture.md, "Server"): one `ChoiceText` per choice turns each
update's tokens into the text they add, for streamed chunks and whole responses alike, so both say the same.

Decoding is incremental over a short window (as vLLM and TGI do): the text a token adds is the window decoded with it
minus the window decoded without it, so tokens that merge with their neighbours (a SentencePiece word start, a BPE
byte pair) come out right, and a window that ends inside a multi-byte character (U+FFFD) waits for the next token.
Stop strings end the text before them, as OpenAI's API does; text that could be the start of a stop string is held
back until the next tokens show whether it is."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decode of an incomplete UTF-8 sequence ends with


class IncrementalDecoder:
    """The text each batch of tokens adds to the tokens before it (special tokens skipped)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # window start: tokens before it no longer change the text
        self.read = 0  # tokens whose text has been given out

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)

    def push(self, tokens: list[int], final: bool = False) -> str:
        """The new text; with `final`, also what an incomplete character held back."""
        self.tokens.extend(tokens)
        before = self._decode(self.prefix, self.read)
        text = self._decode(self.prefix)
        if not final and (text.endswith(REPLACEMENT) or len(text) <= len(before)):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(before):]


class ChoiceText:
    """One choice's text: decoded incrementally, cut before the first stop string."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop_strings = stop_strings
        self.pending = ""  # decoded, not given out: it may be the start of a stop string
        self.stopped = False  # a stop string was found: nothing more is given out
        self.text = ""  # all given out so far

    def push(self, tokens: list[int], final: bool = False) -> str:
        """The text these tokens add (nothing once a stop string ended the text)."""
        if self.stopped:
            return ""
        self.pending += self.decoder.push(tokens, final)
        cut = min((i for i in (self.pending.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._give(cut)
        return self._give(len(self.pending) if final else len(self.pending) - self._held_back())

    def _held_back(self) -> int:
        """Characters at the end of the pending text that begin some stop string."""
        return max((k for s in self.stop_strings for k in range(1, len(s)) if self.pending.endswith(s[:k])),
                   default=0)

    def _give(self, end: int) -> str:
        piece, self.pending = self.pending[:end], self.pending[end:]
        self.text += piece
        return piece
