"""Write verl's dataset for training on ragen's envs with the ``ragen_env`` and ``ragen_agent`` agent loops.

    python -m ragen.tools.verl_data --config-name verl_sokoban --out data/ragen_sokoban [overrides ...]

From ``es_manager``'s env sets of the composed ragen config it writes, in ``--out``:

- ``train.parquet``: one row per group of ``--steps`` training rollouts, with
  RAGEN's seeds (group ``g`` of rollout ``r`` gets ``seed.train + r *
  env_groups + g``) and its tag; verl repeats each row ``rollout.n`` times
  under one uid, so ``rollout.n = group_size`` plays the group, one initial
  state, as GRPO needs;
- ``val.parquet``: the validation groups (the same every time, as in RAGEN);
- ``ragen_config.yaml``: the resolved config the agent loop reads;
- ``agent_loop.yaml``: verl's ``agent_loop_config_path`` file naming it, an entry for each agent
  loop the rows name (``ragen_env`` for env tags, ``ragen_agent`` for ``env_type: agent`` tags);
- ``verl_overrides.txt``: the verl keys these imply (data files, batch size,
  ``rollout.n``, steps, the agent loop path), one per line.

Rows are ``data_source``, ``prompt`` (a placeholder message: the agent loop
builds RAGEN's prompts from the env), ``agent_name``, ``tag``, ``seed``,
``split``, ``reward_model`` and ``extra_info.index``. A train file holds at most
``MAX_TRAIN_ROWS`` rows (``--steps`` times ``es_manager.train.env_groups``). Needs pandas
and pyarrow (``pip install -e '.[verl]'``).
"""

from __future__ import annotations

import argparse
import logging
import numbers
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ragen.config_files import compose
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.types import AGENT_ENV_TYPE
from ragen.verl.setup import ENV_LOOP, LOOP_CLASSES, PROGRAM_LOOP, VerlEnvs

logger = logging.getLogger(__name__)

MAX_TRAIN_ROWS = 1_000_000  # about 1.7 KB of memory a row while the file is written


def group_rows(maker: EnvSpecMaker, rollouts: int, start_index: int = 0) -> list[dict[str, Any]]:
    """One row per group of the split's first ``rollouts`` rollouts (validation: its one set)."""
    rows = []
    for r in range(rollouts):
        for tag, seed in maker.group_seeds(r):
            index = start_index + len(rows)
            rows.append({
                "data_source": f"ragen/{tag}",
                "prompt": [{"role": "user", "content": f"ragen env {tag}, seed {seed}"}],
                "agent_name": PROGRAM_LOOP if maker.tag_specs[tag]["env_type"] == AGENT_ENV_TYPE else ENV_LOOP,
                "tag": tag,
                "seed": int(seed),
                "split": maker.split,
                "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"index": index, "split": maker.split},
            })
    return rows


def build(cfg: Mapping[str, Any], out: Path, steps: int | None = None) -> dict[str, Any]:
    """Writes the files of the module docstring into ``out``; returns what it wrote."""
    from omegaconf import OmegaConf

    # refused here, before verl starts, if the agent loop would refuse it
    makers = VerlEnvs(cfg, "the composed config").makers
    import pandas as pd

    steps = training_steps(cfg, steps, makers["train"].env_groups)
    train = group_rows(makers["train"], steps)
    val = group_rows(makers["val"], 1)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(train).to_parquet(out / "train.parquet")
    pd.DataFrame(val).to_parquet(out / "val.parquet")
    config_path = (out / "ragen_config.yaml").resolve()
    OmegaConf.save(OmegaConf.create(dict(cfg)), config_path)
    loop_path = (out / "agent_loop.yaml").resolve()
    named = {row["agent_name"] for row in train + val}
    loop_path.write_text(yaml.safe_dump([{"name": name, "_target_": target, "ragen_config": str(config_path)}
                                         for name, target in LOOP_CLASSES.items() if name in named], sort_keys=False))
    overrides = [
        f"data.train_files={hydra_path(out / 'train.parquet')}",
        f"data.val_files={hydra_path(out / 'val.parquet')}",
        f"data.train_batch_size={makers['train'].env_groups}",
        "data.shuffle=false",
        f"actor_rollout_ref.rollout.n={makers['train'].group_size}",
        f"actor_rollout_ref.rollout.val_kwargs.n={makers['val'].group_size}",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={hydra_path(loop_path)}",
        f"trainer.total_training_steps={steps}",
    ]
    (out / "verl_overrides.txt").write_text("\n".join(overrides) + "\n")
    return {"train_rows": len(train), "val_rows": len(val), "out": str(out), "overrides": overrides}


def hydra_path(path: Path) -> str:
    """``path``, absolute, as a Hydra override's value: quoted where Hydra's grammar would read its
    characters (``#``, spaces, brackets, quotes), backslashes before a quote or at the end doubled."""
    text = str(path.resolve())
    if re.fullmatch(r"[\w./-]+", text):
        return text
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text) + "'"


def training_steps(cfg: Mapping[str, Any], steps: int | None, env_groups: int) -> int:
    """The training rollouts to write: ``steps`` (``--steps``), else ``trainer.total_training_steps``
    (else 1); a ValueError naming the one at fault when it is not a whole number from 1, or makes
    more than ``MAX_TRAIN_ROWS`` rows of ``env_groups`` groups each."""
    key, given = "--steps", steps
    if steps is None:
        key, given = "trainer.total_training_steps", (cfg.get("trainer") or {}).get("total_training_steps") or 1
    whole = isinstance(given, numbers.Integral) or (isinstance(given, float) and given.is_integer())
    if isinstance(given, bool) or not whole or given < 1:
        raise ValueError(f"{key}={given!r}: a whole number of training rollouts, at least 1")
    steps = int(given)
    if steps * env_groups > MAX_TRAIN_ROWS:
        raise ValueError(f"{key}={given!r}: {steps:,} rollouts of es_manager.train.env_groups={env_groups} groups "
                         f"make {steps * env_groups:,} rows, more than {MAX_TRAIN_ROWS:,}: write fewer rollouts")
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen.tools.verl_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="verl_sokoban", help="a config in config/ (default: verl_sokoban)")
    parser.add_argument("--config-dir", type=Path, default=None,
                        help="where --config-name is looked up (default: the config/ shipped with ragen)")
    parser.add_argument("--out", type=Path, required=True, help="the folder the files go to")
    parser.add_argument("--steps", type=int, default=None,
                        help="training rollouts to write (default: trainer.total_training_steps)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. es_manager.train.env_groups=16")
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.config_name, args.overrides, args.config_dir)
        report = build(cfg, args.out, args.steps)
    except Exception as exc:  # config errors, a missing pyarrow: one line, exit 2
        logger.debug("verl_data failed", exc_info=True)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {report['train_rows']} train and {report['val_rows']} val rows, ragen_config.yaml and "
          f"agent_loop.yaml to {report['out']}\nverl overrides (also in verl_overrides.txt):")
    print(" \\\n  ".join(shlex.quote(o) for o in report["overrides"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
