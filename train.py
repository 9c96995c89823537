"""Train an LLM agent with RL on the rollout engine (Hydra command line).

    python train.py                                   # config/base.yaml
    python train.py --config-name base-parallel       # parallel rollout
    python train.py trainer.total_training_steps=50 actor_rollout_ref.model.lora_rank=16
    python train.py trainer.resume=true trainer.total_training_steps=24  # continue the newest run

Each run writes a fresh run folder, runs/<project>/<experiment>/<date>_<time>
(``trainer.default_local_dir``; its experiment named after what the run trains, e.g. bandit_grpo), and
``latest`` beside it links the newest run that wrote a step.

The logic lives in ``ragen.trainer``; this file parses the config, shows a
progress bar (on a terminal) and the one-line summary of each step, and reports where the
metrics, checkpoints and learning curve went (the curve only where it was drawn).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

if TYPE_CHECKING:
    from ragen.trainer.startup import CheckedRun


def run(checked: CheckedRun) -> dict:
    """Build the trainer from the checked config, train, and return the last step's metrics."""
    from tqdm import tqdm

    from ragen.trainer import AgentTrainer
    from ragen.trainer.trainer import TrainingFailed

    bar = None
    terminal = sys.stderr.isatty()
    if not terminal:  # transformers' own bars (loading the weights) too
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

    def console(line: str) -> None:
        # Printed through tqdm so that the summary lines and the bar do not tear each other.
        (bar.write if bar is not None else print)(line)

    try:
        trainer = AgentTrainer(checked, console=console)
    except ValueError as exc:  # a bad run folder, found at start-up: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        total = trainer.config.run.total_training_steps
        # not on a terminal (a log file): no bar, whose redraws would be glued to the log lines; the
        # step lines say how far the run has got
        bar = tqdm(total=total, initial=trainer.global_step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stderr, disable=not terminal)
        try:
            last = trainer.fit(on_step=lambda step, metrics: bar.update(1))
        except TrainingFailed as exc:  # the run learned nothing: said in one line, and not a success
            bar.close()
            print(f"error: training failed: {exc}\nrun folder: {trainer.run_dir}", file=sys.stderr)
            sys.exit(1)
        bar.close()
        print(f"run folder: {trainer.run_dir}")
        print(f"  metrics:        {trainer.run_dir / 'metrics.jsonl'}")
        print(f"  checkpoints:    {trainer.run_dir / 'checkpoints'}")
        if trainer.curve_path is not None:
            print(f"  learning curve: {trainer.curve_path}")
        return last
    finally:
        if bar is not None:
            bar.close()
        trainer.close()


@hydra.main(config_path="config", config_name="base", version_base=None)
def main(cfg: DictConfig) -> None:
    from ragen.allocator import relaunch_with
    from ragen.config_files import register_resolvers
    from ragen.rollout.workers.executors import interrupt_on_sigterm
    from ragen.trainer.startup import check_run

    register_resolvers()  # trainer.experiment_name's (Hydra registers it too, where ragen's plugin is installed)

    try:
        # the config first, before torch is imported (seconds): a bad key is one line at once
        checked = check_run(cfg)
        # then the allocator: the command runs again with it preloaded, before anything is built
        relaunch_with(checked.config.run.allocator)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

    interrupt_on_sigterm()  # a terminated run shuts down as an interrupted one: workers stopped, none left
    run(checked)


def exit_interrupted(exc: KeyboardInterrupt) -> None:
    """Ends the process as an interrupted one, killed by SIGINT (what a shell and a
    supervisor read as Ctrl-C), after one line saying so and the atexit handlers.
    Python does this itself for a KeyboardInterrupt that reaches the top (with a
    traceback), unless code run while it finalizes resets its flag (then it exits
    with status 1)."""
    import atexit
    import os
    import signal

    print(f"train.py: interrupted ({exc or 'Ctrl-C'}); the rollout's workers are stopped, and a resumed run "
          "(trainer.resume=true) continues from the newest checkpoint", file=sys.stderr)
    sys.stderr.flush()
    atexit._run_exitfuncs()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    sys.exit(128 + signal.SIGINT)  # only where SIGINT is blocked


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as interrupted:  # Ctrl-C, or SIGTERM (interrupt_on_sigterm): every finally has run
        exit_interrupted(interrupted)
