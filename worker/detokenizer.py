"""Incremental detokenization with stop strings, one per sequence.

Tokens decode to text only in context (a multi-byte character can span tokens), so each
step decodes a short window and emits what became stable, as vLLM does. Text that could be
the start of a stop string is held back until it is known not to be one, so a client never
sees part of a stop string.
"""

from __future__ import annotations

from typing import Protocol

_INCOMPLETE = "\ufffd"  # what a decoder yields for a partial UTF-8 sequence


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, stop: tuple[str, ...] = ()) -> None:
        self._decoder = decoder
        self._stop = stop
        self._max_holdback_chars = max((len(s) for s in stop), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._num_emitted_chars = 0
        self.is_stopped = False

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text newly safe to send (maybe "")."""
        self._token_ids.append(token_id)
        delta = self._decode_delta()
        if delta:
            self._append_text(delta)
        return self._take_emittable()

    def flush(self) -> str:
        """All text not yet sent, incomplete characters included: call when the sequence ends."""
        if not self.is_stopped and (delta := self._decode_delta(is_final=True)):
            self._append_text(delta)
        rest = self.text[self._num_emitted_chars :]
        self._num_emitted_chars = len(self.text)
        return rest

    def _decode_delta(self, is_final: bool = False) -> str:
        ids = self._token_ids
        prefix = self._decoder.decode(
            ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = self._decoder.decode(ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or (full.endswith(_INCOMPLETE) and not is_final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix) :]

    def _append_text(self, delta: str) -> None:
        start = max(0, len(self.text) - self._max_holdback_chars)
        self.text += delta
        for stop in self._stop:
            index = self.text.find(stop, start)
            if index != -1:
                self.text = self.text[:index]
                self.is_stopped = True
                return

    def _take_emittable(self) -> str:
        end = len(self.text) if self.is_stopped else len(self.text) - self._max_holdback_chars
        if end <= self._num_emitted_chars:
            return ""
        chunk = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return chunk
