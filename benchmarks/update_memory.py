"""Peak RSS and wall time of one actor update, on a batch the shape of a training step.

``--task sokoban``: 16 episodes (4 groups of 4 sharing a 300-token prompt), each turn a 48-token
answer and 180 tokens of the next prompt (``--turns``), micro batch 8, mini batch 16.
``--task bandit``: the default job's step, 32 single-turn episodes (4 groups of 8) behind one
264-token worked example, a 150-token question a group and 5-10 answer tokens, micro batch 8,
mini batch 32. Random token ids; the default model (SmolLM2-135M, float32) with the default LoRA
(rank 16, alpha 32, all linear layers), two torch threads; ``--updates N`` runs N updates and
reports each (the first pays for warm-up).

    python benchmarks/update_memory.py --task sokoban --turns 3 [--checkpoint-layers] [--allocator mimalloc]

``--autocast bf16`` asks for the bfloat16 decoder (``ragen.trainer.precision``: float32 with a
warning on a CPU without native bf16); ``--emulated-bf16`` runs it there all the same, to measure it.
``--allocator mimalloc`` (or ``tcmalloc``) runs the script again with it preloaded (``ragen.allocator``);
``--mmap-threshold-kb`` fixes glibc's mmap threshold (``mallopt``) instead, so that memory the
update frees goes back to the system at once instead of staying in the heap.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--checkpoint-layers", action="store_true")
    parser.add_argument("--mmap-threshold-kb", type=int, default=None)
    parser.add_argument("--task", choices=("sokoban", "bandit"), default="sokoban")
    parser.add_argument("--updates", type=int, default=1)
    parser.add_argument("--allocator", choices=("system", "mimalloc", "tcmalloc"), default="system")
    parser.add_argument("--autocast", choices=("none", "bf16"), default="none")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the update on a GPU (peak GPU memory too)")
    parser.add_argument("--model", default="default",
                        help="a model folder (default: the embedded model); with --random-weights only its config.json "
                             "(benchmarks/model_configs holds the default model's and Qwen2.5-1.5B's)")
    parser.add_argument("--random-weights", action="store_true",
                        help="the model's architecture with random weights (timing and memory do not depend on them)")
    parser.add_argument("--emulated-bf16", action="store_true",
                        help="with --autocast bf16: run bfloat16 even on a CPU without native bf16 (to measure it)")
    args = parser.parse_args()
    if args.allocator != "system":  # only then: trees from before ragen.allocator run with the system's
        from ragen.allocator import relaunch_with

        relaunch_with(args.allocator)
    torch.set_num_threads(2)
    if args.mmap_threshold_kb is not None:
        ctypes.CDLL("libc.so.6").mallopt(-3, args.mmap_threshold_kb * 1024)  # M_MMAP_THRESHOLD
    from transformers import AutoModelForCausalLM

    from ragen.llm.default_model import resolve_model_path
    from ragen.trainer.actor import PPOActor
    from ragen.trainer.config import ActorSection, ModelSection, OptimSection, TrainerConfig
    from ragen.trainer.core import Sample
    from ragen.trainer.policy import apply_lora

    mini = 32 if args.task == "bandit" else 16
    if args.emulated_bf16:  # as if the CPU listed a native bf16 flag (ragen.trainer.precision)
        from ragen.trainer import precision

        precision.cpu_flags = lambda: {"avx512_bf16"}
    cfg = TrainerConfig(
        actor=ActorSection(ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=8, shuffle=False,
                           optim=OptimSection(lr=1e-5),
                           **({"autocast": args.autocast} if args.autocast != "none" else {})),
        # the key where the tree has it, so that the script also runs on trees from before it
        model=ModelSection(lora_rank=16, lora_alpha=32,
                           **({"enable_gradient_checkpointing": args.checkpoint_layers}
                              if "enable_gradient_checkpointing" in {f.name for f in dataclasses.fields(ModelSection)}
                              else {})))
    torch.manual_seed(0)
    folder = resolve_model_path(args.model)
    if args.random_weights:
        from transformers import AutoConfig

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, local_files_only=True),
                                                 dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    model = model.to(args.device)
    cuda = torch.device(args.device).type == "cuda"
    model = apply_lora(model, cfg.model)
    gen = torch.Generator().manual_seed(1)
    tokens = lambda n: torch.randint(100, 40000, (n,), generator=gen).tolist()  # noqa: E731
    samples = []
    if args.task == "bandit":
        example = tokens(264)
        for group in range(4):
            prompt = example + tokens(150)
            for member in range(8):
                answer = tokens(5 + (member + group) % 6)
                samples.append(Sample(prompt + answer, [0] * len(prompt) + [1] * len(answer),
                                      advantage=float(member % 2) - 0.5, group_key=group))
    for group in range(4 if args.task == "sokoban" else 0):
        prompt = tokens(300)
        for member in range(4):
            ids, mask = list(prompt), [0] * len(prompt)
            for turn in range(args.turns):
                ids, mask = ids + tokens(48), mask + [1] * 48
                if turn + 1 < args.turns:
                    ids, mask = ids + tokens(180), mask + [0] * 180
            samples.append(Sample(ids, mask, advantage=float(member % 2) - 0.5, group_key=group))
    actor = PPOActor(model, cfg, pad_token_id=0)
    for update in range(1, args.updates + 1):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set from here
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        metrics = actor.update(samples, 1)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        with open("/proc/self/status") as f:
            peak_kb = int(next(line for line in f if line.startswith("VmHWM")).split()[1])
        gpu = f", peak GPU memory {torch.cuda.max_memory_allocated() / 1024**3:.2f} GB" if cuda else ""
        print(f"task={args.task} turns={args.turns} tokens/episode={len(samples[0].input_ids)} "
              f"checkpoint_layers={args.checkpoint_layers} allocator={args.allocator} "
              f"mmap_threshold_kb={args.mmap_threshold_kb} autocast={args.autocast}{' (emulated)' if args.emulated_bf16 else ''} "
              f"device={args.device} update {update}: {seconds:.2f} s, "
              f"peak RSS {peak_kb / 1024**2:.2f} GB{gpu}, grad_norm {metrics['actor/grad_norm']:.6f}", flush=True)


if __name__ == "__main__":
    main()
