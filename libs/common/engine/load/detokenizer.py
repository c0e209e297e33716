"""Incremental detokenization that never emits broken UTF-8.

A token can end in the middle of a multi-byte character (byte-level BPE and
SentencePiece byte fallback both split them). Decoding each new token alone
would emit U+FFFD; instead a small window of recent tokens is decoded, and new
text is released only once it no longer ends in a replacement character.
"""

from __future__ import annotations

from libs.common.engine.load.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    """Feed generated ids with `push`; get back the text they complete.

    Contract: the concatenation of every `push` result and the final `flush`
    equals `tokenizer.decode(all ids)` for byte-level BPE vocabularies; no
    returned piece ends inside a character (a trailing U+FFFD is held back
    until the next token completes it, or until `flush` at the end).
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self.ids: list[int] = []
        self.text = ""
        # ids[prefix:read] was decoded last time; ids[read:] is not yet released.
        self._prefix = 0
        self._read = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Release whatever is held back (may contain U+FFFD for truly invalid bytes)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        decode = self._tok.decode
        before = decode(self.ids[self._prefix : self._read], self._skip)
        after = decode(self.ids[self._prefix :], self._skip)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
