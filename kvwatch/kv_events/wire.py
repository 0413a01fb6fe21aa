"""vLLM's KV-cache event batches, as they travel (``vllm/distributed/kv_events.py``, 0.32).

The publisher sends each batch as three ZMQ frames: the topic, the batch's sequence number
(8 bytes, big-endian, from 0 per publisher process) and the batch, msgpack-encoded by
msgspec. A batch is an array ``[ts, events, data_parallel_rank]`` (``ts``: the engine's
``time.time()`` when the step's events were taken; the rank may be missing); each event a
map tagged by ``type``:

- ``BlockStored``: ``block_hashes`` (one per block: the low 64 bits of the block's sha256 as
  an int, vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, else the 32 bytes),
  ``parent_block_hash`` (the block before the first,
  None when the first block starts the prompt), ``token_ids``, ``block_size``, ``lora_id``,
  ``medium``, ``lora_name``, and, in recent versions, ``extra_keys`` (one entry per block:
  the LoRA name, ``[mm_identifier, offset]`` pairs, the cache salt on a prompt's first block,
  prompt-embedding digests as bytes; None where a block has none, and 0.32 sends a list of
  Nones rather than None for a request without any), ``group_idx`` and
  ``session_id`` (the session whose request stored, or in ``kv_cache_report_mode: full``
  reused, the blocks);
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``.

The structs below are kvwatch's own reading of that format (fields it does not read are
ignored, so a newer vLLM's additions decode); ``tests/test_kv_events.py`` checks them
against batches vLLM's own classes encode, and the live test against a real server's.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from kvwatch.kv_events.errors import MalformedBatch

BlockHash = bytes | int
END_SEQ: Final = -1  # the replay socket's end marker, as a signed 8-byte integer


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    session_id: str | None = None

    def salt_of_first_block(self) -> str | None:
        """The cache salt in the first block's extra keys (None: no salt there).

        vLLM puts the salt only into the extra keys of a prompt's first block (the rest
        inherit it through the hash chain), after the LoRA name and the multimodal pairs
        and before the prompt-embedding digests (bytes)."""
        keys = self.extra_keys[0] if self.extra_keys else None
        if not keys:
            return None
        items = list(keys)
        if self.lora_name is not None and items and items[0] == self.lora_name:
            items = items[1:]
        return next((k for k in items if isinstance(k, str)), None)


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch: Final = msgspec.msgpack.Decoder(Batch)
_event: Final = msgspec.msgpack.Decoder(KvEvent)
_type_only: Final = msgspec.msgpack.Decoder(dict[str, Any])


class Decoded(msgspec.Struct, frozen=True):
    """One batch: its seq, the engine's time, the events kvwatch reads, and the tags of the
    events it does not know (a newer vLLM's kinds: counted, never guessed at)."""

    seq: int
    ts: float
    events: list[KvEvent]
    unknown: list[str]
    data_parallel_rank: int | None = None


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedBatch(f"a sequence frame of {len(frame)} bytes (vLLM sends 8)")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(seq: int, payload: bytes) -> Decoded:
    """Decode one batch's payload; :class:`MalformedBatch` when it is not vLLM's."""
    try:
        batch = _batch.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedBatch(f"batch {seq}: {exc}") from None
    events: list[KvEvent] = []
    unknown: list[str] = []
    for raw in batch.events:
        try:
            events.append(_event.decode(raw))
        except msgspec.ValidationError as exc:
            try:
                tag = _type_only.decode(raw).get("type")
            except (msgspec.DecodeError, msgspec.ValidationError):
                tag = None
            if not isinstance(tag, str) or tag in ("BlockStored", "BlockRemoved"):
                raise MalformedBatch(f"batch {seq}: {exc}") from None
            unknown.append(tag[:64])
        except msgspec.DecodeError as exc:
            raise MalformedBatch(f"batch {seq}: {exc}") from None
    return Decoded(seq, batch.ts, events, unknown, batch.data_parallel_rank)
