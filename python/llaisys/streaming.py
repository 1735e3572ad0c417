"""Incremental detokenization: turn generated token ids into text deltas as they arrive.

Byte-level BPE tokens are bytes, not characters: an emoji or a CJK character often spans 2-4 tokens, and
decoding each token alone would print U+FFFD garbage. tokenizers' DecodeStream keeps the undecoded tail and
returns text only once it forms whole characters, so every delta is valid text and all deltas together equal
``tokenizer.decode(all_ids)`` (when the ids end on a character boundary; flush() returns the rest otherwise).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens given to DecodeStream as context by prefill(). A few suffice: decoders only look at
# neighbouring tokens (e.g. SentencePiece's leading-space rule); byte-level BPE needs none.
_CONTEXT = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer_inner, skip_special_tokens: bool = True):
        self._tok = tokenizer_inner  # a tokenizers.Tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []  # ids already turned into text, the last few (for flush())
        self._pending: list[int] = []  # ids fed since the last non-empty piece
        self._started = False

    def prefill(self, prompt_ids) -> None:
        """Decode what follows `prompt_ids` in their context. Not needed for byte-level BPE (Qwen2), whose
        tokens decode the same anywhere; decoders such as SentencePiece's drop a leading space at the
        start of a text, which the prompt context avoids. Call before the first step()."""
        if self._started:
            raise RuntimeError("prefill() must come before step()")
        self._restart([int(t) for t in list(prompt_ids)[-_CONTEXT:]])

    def _restart(self, ids: list[int]) -> None:
        # A context ending inside a character would make DecodeStream re-emit it: drop such a tail.
        while ids and self._tok.decode(ids, skip_special_tokens=self._skip).endswith("\ufffd"):
            ids.pop()
        self._context = ids
        self._stream = DecodeStream(ids or None, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Feed one generated id; return the newly finished text ("" while a character is incomplete)."""
        token_id = int(token_id)
        self._started = True
        text = self._stream.step(self._tok, token_id)
        self._pending.append(token_id)
        if text:  # the context's last ids, in place (this runs per token of every streamed request)
            context = self._context
            context += self._pending
            del context[:-_CONTEXT]
            self._pending.clear()
            return text
        return ""

    def decode_all(self, token_ids, ints: bool = False) -> str:
        """The text that step() of each id and then flush() would return together, in one decode: for
        output that nobody reads piece by piece (no stream, no stop strings). ints: token_ids is a list of
        Python ints (a sequence's output), taken as it is (not changed) rather than converted id by id."""
        if self._pending:
            raise RuntimeError("decode_all() after step(): flush() first")
        self._pending = token_ids if ints else list(map(int, token_ids))
        return self.flush()

    def flush(self) -> str:
        """At the end of generation: the text of ids still pending (an incomplete character decodes to
        U+FFFD, as in tokenizer.decode), so all pieces together equal decode(all ids). Resets the stream."""
        if not self._pending:
            return ""
        ids = self._context + self._pending
        head = self._tok.decode(self._context, skip_special_tokens=self._skip) if self._context else ""
        full = self._tok.decode(ids, skip_special_tokens=self._skip)
        if full.startswith(head):
            text = full[len(head):]
        else:  # not expected for byte-level BPE; decoding the pending ids alone is the safe fallback
            text = self._tok.decode(self._pending, skip_special_tokens=self._skip)
        self._context, self._pending = ids[-_CONTEXT:], []
        self._restart(self._context)
        return text
