"""vLLM's own KV-events publisher, driven over stdin (run in .venv-vllm).

Usage: ``python tests/engines/vllm/kv_events_publisher.py ENDPOINT REPLAY_ENDPOINT BUFFER_STEPS
HWM``. Binds vLLM's ``ZmqEventPublisher`` (its PUB socket, its ROUTER replay socket, its
replay buffer and sequence numbers) and publishes ``KVEventBatch``es of vLLM's own event
classes, so what ``tests/test_kv_events.py`` decodes is what vLLM sends. One JSON command per
line on stdin, one answer line on stdout:

- ``{"batches": [[EVENT, ...], ...], "pad": N}``: publish each batch (``pad`` more token ids
  per stored event: big batches, so that a subscriber that does not read fills the socket
  buffers and ZMQ's PUB drops, as it does in production); answers ``{"next_seq": S}`` once
  vLLM's publisher thread has sent them all;
- ``{"restart": true, "buffer_steps": N}``: shut the publisher down and bind a new one on
  the same endpoints (seqs from 0 again, an empty replay buffer), as a restarted engine does;
- EVENT: ``{"stored": [H, ...], "parent": H|null, "salt": S|null, "session": S|null}``,
  ``{"removed": [H, ...]}`` or ``{"cleared": true}``; a hash H is an int, sent as the 32
  bytes vLLM's sha256 hashing gives.
"""

from __future__ import annotations

import json
import sys
import time

BLOCK = 32


def _hash(h: int) -> bytes:
    return h.to_bytes(32, "big")


def main() -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    endpoint, replay = sys.argv[1], sys.argv[2]
    buffer_steps, hwm = int(sys.argv[3]), int(sys.argv[4])

    def make() -> ZmqEventPublisher:
        return ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=endpoint,
            replay_endpoint=replay,
            buffer_steps=buffer_steps,
            hwm=hwm,
        )

    pub = make()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("restart"):
            buffer_steps = int(cmd.get("buffer_steps", buffer_steps))
            pub.shutdown()
            time.sleep(0.2)
            pub = make()
            print(json.dumps({"ready": True}), flush=True)
            continue
        pad = int(cmd.get("pad", 0))
        for spec in cmd["batches"]:
            events = []
            for e in spec:
                if "stored" in e:
                    n = len(e["stored"])
                    salt = e.get("salt")
                    extra = [(salt,) if salt else None] + [None] * (n - 1)
                    parent = e.get("parent")
                    events.append(
                        BlockStored(
                            block_hashes=[_hash(h) for h in e["stored"]],
                            parent_block_hash=None if parent is None else _hash(parent),
                            token_ids=list(range(n * BLOCK + pad)),
                            block_size=BLOCK,
                            lora_id=None,
                            medium="GPU",
                            lora_name=None,
                            extra_keys=extra if e.get("parent") is None and salt else None,
                            group_idx=0,
                            session_id=e.get("session"),
                        )
                    )
                elif "removed" in e:
                    events.append(
                        BlockRemoved(block_hashes=[_hash(h) for h in e["removed"]], medium="GPU")
                    )
                else:
                    events.append(AllBlocksCleared())
            pub.publish(KVEventBatch(ts=time.time(), events=events))
        while not pub._event_queue.empty() or pub._event_queue.unfinished_tasks:
            time.sleep(0.01)
        print(json.dumps({"next_seq": len(pub._buffer) and pub._buffer[-1][0] + 1}), flush=True)
    pub.shutdown()


if __name__ == "__main__":
    main()
