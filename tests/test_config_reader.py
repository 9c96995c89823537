"""The typed config reader (``ragen.config_reader``) and the sections it reads.

Two kinds of test: bad input is refused naming the key (a misspelt key with a
suggestion, a string for a boolean, a number out of range), and the shipped
``config/`` YAML, the README's key tables and the section dataclasses agree
(every key known, every field listed, the same defaults), so they cannot drift.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from ragen.config_reader import read, section_keys, setting, to_plain
from ragen.gateway.gateway import GatewaySettings
from ragen.llm import ENGINE_CLASSES
from ragen.llm_agent import AgentSetup
from ragen.rollout.config import ROLLOUT_SECTIONS
from ragen.trainer.config import TRAINER_SECTIONS

from tests.rollout_helpers import ROOT, custom_envs

SECTIONS = {**ROLLOUT_SECTIONS, **TRAINER_SECTIONS, "gateway": GatewaySettings}
CONFIG = ROOT / "config"

# Keys that config/base.yaml and trainer_defaults.yaml set to something other
# than the code default, on purpose: they configure the default job (`python
# train.py` learns Bandit on a 2-core CPU within minutes), while the code
# default is what a config that leaves the key out gets.
DEFAULT_JOB = {
    "agent_proxy.max_turn": "Bandit is one answer per episode; the code default (5) is RAGEN's",
    "agent_proxy.enable_think": "short answers on a CPU; the code default is RAGEN's think-then-answer",
    "ctx_manager.generation.response_length": "each shipped tag plays to its own max_tokens (600: the code envs')",
    "seed.train": "RAGEN's seeds",
    "seed.val": "RAGEN's seeds",
    "trainer.experiment_name": "named after what the run trains (the ragen.run_name resolver)",
    "trainer.total_training_steps": "enough steps to see learning on a CPU",
    "trainer.test_freq": "validates a few times within those steps",
    "trainer.save_freq": "checkpoints twice within those steps",
    "trainer.seed": "${seed.train}, which is what the code default (null) means too",
    "actor_rollout_ref.model.lora_rank": "LoRA learns faster on a CPU; the code default trains every weight",
    "actor_rollout_ref.model.lora_alpha": "goes with the LoRA rank",
    "actor_rollout_ref.actor.optim.lr": "an lr for LoRA; the code default is for full fine-tuning",
    "actor_rollout_ref.rollout.max_model_len": "bounds memory on a CPU; the code default does not cut",
    "algorithm.norm_adv_by_std_in_grpo": "Dr. GRPO suits Bandit (see the comment in trainer_defaults.yaml)",
    "gateway.port": "python -m ragen.tools.gateway listens on a port to remember; the code default (0) is a free one",
}
# Keys without a code default: every config must set them.
REQUIRED = {"trainer.default_local_dir", "es_manager.train.env_groups", "es_manager.train.group_size",
            "es_manager.val.env_groups", "es_manager.val.group_size"}


def leaves(node, prefix: str = ""):
    """(dotted key, value) of every leaf of a YAML mapping; lists are leaves."""
    for key, value in node.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from leaves(value, dotted)
        else:
            yield dotted, value


def load(path: Path) -> dict:
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    data.pop("defaults", None)
    return data


def code_default(dotted: str):
    """The default of a section field (nested sections walked), or MISSING."""
    section, *path = dotted.split(".")
    cls = SECTIONS[section]
    for name in path[:-1]:
        cls = typing.get_type_hints(cls)[name]
        cls = next((a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)), cls)  # Section | None
    f = {f.name: f for f in dataclasses.fields(cls)}[path[-1]]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def plain(value):
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------- the YAML, the README and the code agree


def yaml_files():
    return sorted(CONFIG.glob("*.yaml")) + sorted(CONFIG.glob("*/*.yaml"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(CONFIG)))
def test_every_key_in_config_is_known_to_the_reader(path):
    data = load(path)
    if path.parent.name == "engine":
        name = data["name"]
        assert name in ENGINE_CLASSES
        from ragen.llm import _load_class

        engine_class = _load_class(name)
        assert set(data) - {"name"} <= {*engine_class.config_keys, *engine_class.replica_keys}, path
        if "routing" in data:  # engine.routing: the Routing section's keys, every one
            import dataclasses

            from ragen.llm.replicas import Routing

            assert set(data["routing"]) == {f.name for f in dataclasses.fields(Routing)}, path
        return
    known = set().union(*(section_keys(cls, name) for name, cls in SECTIONS.items()))
    wildcards = {k[:-2] for k in known if k.endswith(".*")}
    checked = 0
    for section in set(data) & set(SECTIONS):
        for key, _ in leaves({section: data[section]}):
            assert key in known or any(key.startswith(w + ".") for w in wildcards), f"{path.name}: {key}"
            checked += 1
    if path.name in ("base.yaml", "trainer_defaults.yaml"):
        assert checked > 20


@pytest.mark.timeout(60)
def test_every_section_field_is_listed_in_the_shipped_yaml():
    listed = set()
    for name in ("base.yaml", "trainer_defaults.yaml", "cluster/dask.yaml", "cluster/ray.yaml"):
        listed |= {key for key, _ in leaves(load(CONFIG / name))}
    for section, cls in SECTIONS.items():
        for key in section_keys(cls, section):
            assert key.removesuffix(".*") in listed, f"{key} is not in config/base.yaml, trainer_defaults.yaml " \
                                                     "or cluster/*.yaml"


@pytest.mark.timeout(60)
def test_shipped_yaml_values_are_the_code_defaults_except_the_default_job():
    seen_job, seen_required = set(), set()
    # the cluster presets turn the parallel rollout on; only their own sections hold defaults
    for name, sections in (("base.yaml", SECTIONS), ("trainer_defaults.yaml", SECTIONS),
                           ("cluster/dask.yaml", ("dask", "llm_server")), ("cluster/ray.yaml", ("ray", "llm_server"))):
        data = load(CONFIG / name)
        for key, value in leaves({k: v for k, v in data.items() if k in sections}):
            default = code_default(key)
            if default is dataclasses.MISSING:
                seen_required.add(key)
                continue
            if key in DEFAULT_JOB:
                seen_job.add(key)
                assert value != plain(default), f"{key} agrees with the code now: drop it from DEFAULT_JOB"
            elif key.startswith("es_manager.") and key.endswith(("env_configs.tags", "env_configs.n_groups")):
                continue  # the default job's env layout; the code default is empty (an error)
            else:
                assert value == plain(default), f"config/{name}: {key} is {value!r}, the code default is {default!r}"
    assert seen_job == set(DEFAULT_JOB)
    assert seen_required == REQUIRED


def readme_rows(header: str):
    """(keys, default text) of each row of the README table under ``header``."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            return
        cells = [c.strip() for c in line.strip("|").split("|")]
        yield re.findall(r"`([^`]+)`", cells[0]), cells[1].strip("`")


@pytest.mark.timeout(60)
def test_readme_key_tables_give_the_code_defaults():
    rows = list(readme_rows("| key (`agent_proxy.`)"))
    assert len(rows) >= 10
    for keys, text in rows:
        for key in keys:
            assert yaml.safe_load(text) == code_default(f"agent_proxy.{key}"), f"README: agent_proxy.{key}"
    cluster_rows = list(readme_rows("| key | default | meaning |"))
    assert {k for keys, _ in cluster_rows for k in keys} >= {"llm_server.host", "llm_server.port", "dask.n_workers"}
    for keys, text in cluster_rows:
        for key in keys:
            assert yaml.safe_load(text) == code_default(key), f"README: {key}"


# ---------------------------------------------------------------- bad input, named


def minimal(**agent_proxy) -> dict:
    return {
        "custom_envs": custom_envs(),
        "agent_proxy": {"max_turn": 2, **agent_proxy},
        "es_manager": {
            "train": {"env_groups": 2, "group_size": 1, "env_configs": {"tags": ["Bandit"], "n_groups": [2]}},
            "val": {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["Bandit"], "n_groups": [1]}},
        },
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_proxy, message", [
    ({"parallel_njobs": 4}, "agent_proxy.parallel_njobs is not a known key (did you mean 'parallel_n_jobs'?)"),
    ({"pipline_depth": 4}, "agent_proxy.pipline_depth is not a known key (did you mean 'pipeline_depth'?)"),
    ({"reward_normalization": {"methd": "mean"}},
     "agent_proxy.reward_normalization.methd is not a known key (did you mean 'method'?)"),
    ({"use_parallel_rollout": "false"}, "agent_proxy.use_parallel_rollout must be true or false, got 'false'"),
    ({"fallback_to_sequential": 1}, "agent_proxy.fallback_to_sequential must be true or false, got 1"),
    ({"parallel_n_jobs": True}, "agent_proxy.parallel_n_jobs must be auto (sized from each rollout), -1 (one worker per core) or a positive integer, got True"),
    ({"parallel_n_jobs": 2.5}, "agent_proxy.parallel_n_jobs must be auto (sized from each rollout), -1 (one worker per core) or a positive integer, got 2.5"),
    ({"parallel_n_jobs": 0}, "agent_proxy.parallel_n_jobs must be auto (sized from each rollout), -1 (one worker per core) or a positive integer, got 0"),
    ({"parallel_n_jobs": "four"}, "agent_proxy.parallel_n_jobs must be auto (sized from each rollout), -1 (one worker per core) or a positive integer, got 'four'"),
    ({"pipeline_depth": 0}, "agent_proxy.pipeline_depth must be >= 1, got 0"),
    ({"coalesce_wait_s": -0.1}, "agent_proxy.coalesce_wait_s must be >= 0.0, got -0.1"),
    ({"env_timeout_s": "10"}, "agent_proxy.env_timeout_s must be a number or null, got '10'"),
    ({"parallel_backend": "lokky"}, "agent_proxy.parallel_backend: unknown 'lokky' (did you mean 'loky'?)"),
    ({"rollout_filter": "nonzero"}, "agent_proxy.rollout_filter: unknown 'nonzero' (did you mean 'nonzero_variance'?)"),
    # 0 would silently mean "no limit": refused, with null named as the way to say it
    ({"env_timeout_s": 0}, "agent_proxy.env_timeout_s must be > 0 seconds, got 0; for no limit write null"),
    ({"rollout_timeout_s": 0.0}, "agent_proxy.rollout_timeout_s must be > 0 seconds, got 0; for no limit write null"),
    ({"engine_timeout_s": 0}, "agent_proxy.engine_timeout_s must be > 0 seconds, got 0; for no limit write null"),
    ({"rollout_mode": "fully_async", "parallel_backend": "dask"},
     "agent_proxy.parallel_backend='dask': rollout_mode fully_async keeps its groups in flight on this machine, "
     "on one of ('loky', 'threading')"),
])
def test_bad_agent_proxy_keys_are_refused_naming_the_key(agent_proxy, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AgentSetup.from_config(minimal(**agent_proxy))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("section, value, message", [
    ("ctx_manager", {"generation": {"top_p": 1.5}}, "ctx_manager.generation.top_p must be <= 1.0, got 1.5"),
    ("ctx_manager", {"generaton": {}}, "ctx_manager.generaton is not a known key (did you mean 'generation'?)"),
    ("llm_server", {"prot": 7000}, "llm_server.prot is not a known key (did you mean 'port'?)"),
    ("seed", {"train": "7"}, "seed.train must be an integer, got '7'"),
    ("es_manager", {"format_penalty": -0.1, "trian": {}}, "es_manager.trian is not a known key"),
    ("dask", {"n_workers": 0}, "dask.n_workers must be >= 1, got 0"),
])
def test_bad_keys_of_the_other_rollout_sections_are_refused(section, value, message):
    cfg = minimal()
    cfg[section] = {**cfg.get(section, {}), **value}
    with pytest.raises(ValueError, match=re.escape(message)):
        AgentSetup.from_config(cfg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split, value, message", [
    ("train", {"group_size": 10**7}, "es_manager.train.group_size must be <= 16384, got 10000000"),
    ("val", {"env_groups": 10**6, "env_configs": {"tags": ["Bandit"], "n_groups": [10**6]}},
     "es_manager.val.env_groups must be <= 16384, got 1000000"),
    ("train", {"env_groups": 128, "group_size": 256, "env_configs": {"tags": ["Bandit"], "n_groups": [128]}},
     "es_manager.train: env_groups x group_size = 128 x 256 = 32768 envs, more than the 16384 envs one rollout "
     "plays at most"),
])
def test_the_envs_of_a_rollout_are_bounded_naming_the_key(split, value, message):
    from ragen.rollout.config import read_rollout_sections
    from ragen.rollout.envs import EnvSpecMaker

    cfg = minimal()
    cfg["es_manager"][split].update(value)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_rollout_sections(cfg)
    with pytest.raises(ValueError, match=re.escape(message)):
        AgentSetup.from_config(cfg)
    with pytest.raises(ValueError, match=re.escape(message)):  # the env set alone (RAGEN's EnvStateManager's)
        EnvSpecMaker(split, cfg["es_manager"][split], cfg["custom_envs"], 0)
    cfg["es_manager"][split].update(env_groups=128, group_size=128, env_configs={"tags": ["Bandit"],
                                                                                 "n_groups": [128]})
    assert AgentSetup.from_config(cfg).es[split].num_envs == 16384  # the bound itself is played


@pytest.mark.timeout(60)
def test_a_split_is_needed_only_where_it_is_played():
    from ragen.rollout.config import read_rollout_sections

    cfg = minimal()
    del cfg["es_manager"]["val"]
    assert read_rollout_sections(cfg)["es_manager"].val is None  # RAGEN's EnvStateManager of mode train reads this
    with pytest.raises(ValueError, match=re.escape("es_manager.val is missing")):
        AgentSetup.from_config(cfg)  # training validates on val
    cfg["es_manager"]["vall"] = {}
    with pytest.raises(ValueError, match=re.escape("es_manager.vall is not a known key (did you mean 'val'?)")):
        read_rollout_sections(cfg)


@pytest.mark.timeout(60)
def test_a_bad_seed_train_is_named_as_itself_not_as_the_trainer_seed_that_copies_it():
    """trainer_defaults.yaml sets trainer.seed: ${seed.train}; the error names the key the user wrote."""
    from hydra import compose, initialize_config_dir

    from ragen.trainer.config import TrainerConfig

    with initialize_config_dir(config_dir=str(CONFIG), version_base=None):
        cfg = OmegaConf.to_container(compose("base", overrides=["seed.train=x"]), resolve=True)
    with pytest.raises(ValueError, match=re.escape("seed.train must be an integer, got 'x'")):
        TrainerConfig.from_config(cfg)


@pytest.mark.timeout(60)
def test_setup_holds_the_sections_whole():
    setup = AgentSetup.from_config(minimal(parallel_n_jobs=3, use_parallel_rollout=True))
    assert setup.agent_proxy.parallel_n_jobs == 3 and setup.agent_proxy.use_parallel_rollout is True
    assert setup.agent_proxy.pipeline_depth == 2  # the documented default
    assert setup.llm_server.host == "127.0.0.1"
    assert setup.es_manager.train.env_configs.tags == ("Bandit",)


@dataclass(frozen=True)
class _Inner:
    names: tuple[str, ...] = ()
    free: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class _Outer:
    ratio: float = setting(0.5, minimum=0.0, maximum=1.0)
    count: int | None = setting(None, minimum=1)
    mode: str = setting("a", choices=("a", "b"))
    pair: tuple[float, float] = (0.0, 1.0)
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    sizes: tuple[int, ...] = setting((), minimum=1)  # a bound on a list holds for each item


@pytest.mark.timeout(30)
def test_reader_types():
    out = read(_Outer, {"ratio": 1, "count": None, "pair": [1, 2], "inner": {"names": ["x"], "free": {"k": [1]}}},
               "s")
    assert out == _Outer(ratio=1.0, count=None, pair=(1.0, 2.0), inner=_Inner(names=("x",), free={"k": [1]}))
    assert isinstance(out.ratio, float)
    assert read(_Outer, None, "s") == _Outer()
    for data, message in [
        ({"ratio": 1.5}, "s.ratio must be <= 1.0"),
        ({"ratio": float("nan")}, "s.ratio must be a number, got NaN"),
        ({"count": 0}, "s.count must be >= 1"),
        ({"mode": "c"}, "s.mode: unknown 'c'"),
        ({"pair": [1]}, "s.pair must be a list of 2 values"),
        ({"inner": {"names": [1]}}, "s.inner.names[0] must be a string, got 1"),
        ({"inner": {"names": "x"}}, "s.inner.names must be a list, got 'x'"),
        ({"inner": []}, "s.inner must be a mapping of keys"),
        ({"inner": {"nams": []}}, "s.inner.nams is not a known key (did you mean 'names'?)"),
        ({"zzz": 1}, "s.zzz is not a known key; the keys of s are"),
        ({"sizes": [2, 0]}, "s.sizes[1] must be >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            read(_Outer, data, "s")
    assert read(_Outer, {"sizes": [1, 3]}, "s").sizes == (1, 3)
    assert set(section_keys(_Outer, "s")) == {"s.ratio", "s.count", "s.mode", "s.pair", "s.sizes", "s.inner.names",
                                              "s.inner.free", "s.inner.free.*"}
    assert to_plain(OmegaConf.create({"a": [1, {"b": 2}]})) == {"a": [1, {"b": 2}]}


# ---------------------------------------------------------------- the command line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("override, message", [
    ("+agent_proxy.parallel_njobs=4", "agent_proxy.parallel_njobs is not a known key (did you mean 'parallel_n_jobs'?)"),
    ("es_manager.train.group_size=10000000", "es_manager.train.group_size must be <= 16384, got 10000000"),
])
def test_train_py_refuses_a_bad_key_before_any_model_loads(tmp_path, override, message):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "train.py", override,
                           f"hydra.run.dir={tmp_path / 'hydra'}", "model_path=/nonexistent/model"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, args, message", [
    # every start-up check runs, the last (model_path) failing, on the default engine (hf) and on vllm
    ("train.py", ["model_path=/nonexistent/model"], "model_path='/nonexistent/model' is not"),
    ("train.py", ["engine=vllm", "model_path=/nonexistent/model"], "model_path='/nonexistent/model' is not"),
    ("train.py", ["engine.max_batch_size=0"], "engine.max_batch_size=0 must be an integer >= 1"),
    ("train.py", ["engine=scripted"], "engine.name='scripted' cannot be trained"),
    ("test_parallel_rollout.py", ["engine=scripted", "benchmark.repeats=0"], "benchmark.repeats must be >= 1"),
])
def test_the_command_lines_check_the_config_without_importing_torch(tmp_path, script, args, message):
    """torch and transformers take seconds to import: a bad config is refused before they are."""
    proc = subprocess.run([sys.executable, "-X", "importtime", script, *args, f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=100)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "ragen.trainer.config" in imported
    assert not imported & {"torch", "transformers"}, sorted(imported & {"torch", "transformers"})
