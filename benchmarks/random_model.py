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

SMOLLM2_135M_SIZES = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, initializer_range=0.02,
)


def main() -> None:
    from ragen.llm.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build_tiny_model(args.path, args.seed, **SMOLLM2_135M_SIZES)
    print(f"wrote {args.path}")


if __name__ == "__main__":
    main()
