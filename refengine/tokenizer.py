"""Byte-level tokenizer: one token per UTF-8 byte, plus four special tokens.

Special tokens never come out of :meth:`ByteTokenizer.encode` — text that spells
``<|eos|>`` encodes as its bytes — so a client cannot inject them. Decoding skips them and
replaces invalid UTF-8 (a completion cut mid-character, or stale bytes read from another
request's KV) with U+FFFD instead of raising.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

BOS = 256
EOS = 257
PAD = 258
#: The one token the legacy rejection path prefills instead of an over-pool prompt.
PLACEHOLDER = 259
VOCAB_SIZE = 260
SPECIAL_NAMES = {BOS: "<|bos|>", EOS: "<|eos|>", PAD: "<|pad|>", PLACEHOLDER: "<|placeholder|>"}


def is_special(token: int) -> bool:
    return token >= 256


class ByteTokenizer:
    """Stateless; one instance can be shared by every thread."""

    bos = BOS
    eos = EOS
    pad = PAD
    placeholder = PLACEHOLDER
    vocab_size = VOCAB_SIZE

    def encode_bytes(self, text: str) -> bytes:
        """The prompt as token ids packed one per byte (ids 0..255); the compact form the
        engine keeps, since a million-token prompt as a list of ints would cost ~30 MB."""
        return text.encode("utf-8")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def count(self, text: str) -> int:
        """Prompt tokens of ``text`` without materialising them."""
        return len(text.encode("utf-8"))

    def decode(self, tokens: Iterable[int], *, skip_special: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for t in tokens:
            if t < 256:
                out.append(t)
            elif not skip_special:
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(SPECIAL_NAMES.get(t, f"<|{t}|>"))
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces for streaming.

    A multi-byte character split across steps is held back until it completes, so the
    concatenation of every piece (with ``final=True`` on the last call) equals
    ``ByteTokenizer().decode(all_tokens)``.
    """

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Iterable[int], *, final: bool = False) -> str:
        data = bytes(t for t in tokens if t < 256)
        return self._dec.decode(data, final=final)
