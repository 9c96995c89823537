"""A random-weight model shaped like SmolLM2-135M, for timing engines on a GPU.

    python benchmarks/random_model.py /tmp/smol-random

Writes a Llama-style model with SmolLM2-135M's layer sizes (30 layers, hidden
576, 9 heads, 3 KV heads) and ragen's tiny tokenizer (its 512-token
vocabulary, so the model has 106M parameters instead of 135M) to the folder
given, for ``model_path=``. Nothing is downloaded: on a machine that cannot
carry the embedded model's 98 MB GGUF file (a lent GPU reaches no hub), a
forward pass and a decode step cost what SmolLM2's do. The text is gibberish,
so no answer parses: every episode runs to ``max_turn`` with the format
penalty, which makes every turn a full batch.
"""

from __future__ import annotations

import argparse


def build(path: str, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ragen.llm.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.path, args.seed)
    print(f"wrote {args.path}")


if __name__ == "__main__":
    main()
