"""Write a tiny randomly initialised Llama and its tokenizer to a directory (run in .venv-vllm).

Usage: ``python tests/engines/vllm/tiny_model.py OUT_DIR``. Two layers, hidden size 128, one
KV head of size 64 (a head size vLLM's CPU attention supports), a 300-token byte-level BPE
tokenizer trained on one sentence. Everything is built locally (no hub access): the weights
are random, so the text it generates is noise, which is all a probe test needs. The same
seed gives the same model, so runs are comparable.
"""

from __future__ import annotations

import sys
from pathlib import Path


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
