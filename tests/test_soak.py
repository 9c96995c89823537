"""The soak command (``ragen.tools.soak``): a short run reports every field, workers
are reused across rollouts, and the growth checks catch what they should."""

from __future__ import annotations

import json

import pytest

from ragen.tools.soak import compose_config, descendants, growth_checks, main, sample, validation_layout

SMALL = ["es_manager.train.env_groups=4", "es_manager.train.group_size=2",
         "es_manager.train.env_configs.n_groups=[2,2]", "agent_proxy.parallel_n_jobs=2", "agent_proxy.max_turn=3"]
ROW_KEYS = {"rollout", "wall_s", "driver_rss_mb", "driver_threads", "fds", "children", "descendants", "worker_pids",
            "worker_rss_mb", "trajectories", "fallbacks", "errors", "success"}


def test_short_soak_reports_and_reuses_workers(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert main(["--rollouts", "5", "--json", str(out), *SMALL]) == 0
    text = capsys.readouterr().out
    assert "first" in text and "last" in text and "worker PIDs stable" in text and "OK" in text
    report = json.loads(out.read_text())
    assert report["ok"] and report["config"]["envs"] == 8 and report["config"]["engine"] == "scripted"
    rows = report["rollouts"]
    assert [r["rollout"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["trajectories"] == 8 and r["fallbacks"] == 0
        assert r["driver_rss_mb"] > 10 and r["fds"] > 3 and r["driver_threads"] >= 3
    pids = rows[0]["worker_pids"]
    assert len(pids) >= 2 and all(r["worker_pids"] == pids for r in rows)  # reused, not respawned
    assert rows[0]["worker_rss_mb"] > 10
    assert {c["name"] for c in report["checks"]} == {"driver RSS", "worker RSS", "driver fds", "driver threads",
                                                     "child processes", "workers reused", "trajectories"}


def test_validation_sized_run_reports_memory_per_env(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert main(["--envs", "40", "--rollouts", "2", "--tags", "Bandit,FrozenLake,Countdown", "--json", str(out),
                 "agent_proxy.parallel_n_jobs=2"]) == 0
    assert "KB/env" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["envs"] == 40 and report["config"]["group_size"] == 1
    assert report["config"]["tags"] == ["Bandit", "Countdown", "FrozenLake"]
    mem = report["memory_per_env"]
    assert mem["envs"] == 40 and {"first_driver_kb_per_env", "last_worker_kb_per_env"} <= set(mem)
    assert report["baseline"]["worker_pids"] == report["rollouts"][0]["worker_pids"]


def test_validation_layout_spreads_envs_over_tags():
    assert validation_layout(10, ["A", "B", "C"]) == {
        "env_groups": 10, "group_size": 1, "env_configs": {"tags": ["A", "B", "C"], "n_groups": [4, 3, 3]}}
    assert validation_layout(2, ["A", "B", "C"])["env_configs"] == {"tags": ["A", "B"], "n_groups": [1, 1]}


def _row(i, pids=(1, 2), fallbacks=0, rss=50.0, fds=20, threads=8, kids=4, wrss=100.0):
    return {"rollout": i, "worker_pids": list(pids), "fallbacks": fallbacks, "driver_rss_mb": rss, "fds": fds,
            "driver_threads": threads, "descendants": kids, "trajectories": 8, "worker_rss_mb": wrss}


def _failed(rows):
    return {c["name"] for c in growth_checks(rows, 10, 8.0, 2, 2, 0, 8) if not c["ok"]}


def test_growth_checks():
    steady = [_row(i) for i in range(1, 21)]
    assert _failed(steady) == set()
    leaky = [_row(i, rss=50 + i, fds=20 + i, threads=8 + i, kids=4 + i, wrss=100 + 5 * i) for i in range(1, 21)]
    assert _failed(leaky) == {"driver RSS", "driver fds", "driver threads", "child processes", "worker RSS"}
    # growth before the reference rollout (warm-up) is not a leak
    warmup = [_row(i, rss=30 + 2 * min(i, 10)) for i in range(1, 21)]
    assert _failed(warmup) == set()
    respawned = steady[:5] + [_row(i, pids=(3, 4)) for i in range(6, 21)]
    assert _failed(respawned) == {"workers reused"}
    # new workers after a fault (a fallback rollout) are expected
    faulted = steady[:5] + [_row(6, pids=(3, 4), fallbacks=1)] + [_row(i, pids=(5, 6)) for i in range(7, 21)]
    assert _failed(faulted) == set()
    lost = steady[:-1] + [{**_row(20), "trajectories": 7}]
    assert _failed(lost) == {"trajectories"}


def test_proc_scan_sees_this_process_children():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert proc.pid in [p["pid"] for p in descendants()]
        s = sample()
        assert proc.pid in s["worker_pids"] and s["children"] >= 1
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override,needle", [
    ("es_manager.train.env_configs.tags=[NoSuchTag,FrozenLake]", "NoSuchTag"),
    ("+agent_prox.max_turn=2", "agent_prox is not a known key (did you mean 'agent_proxy'?)"),
    ("+agent_proxy.pipline_depth=2", "agent_proxy.pipline_depth is not a known key (did you mean 'pipeline_depth'?)"),
])
def test_bad_config_is_one_clear_line(capsys, override, needle):
    assert main(["--rollouts", "1", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and needle in err and len(err.strip().splitlines()) == 1


def test_engine_defaults_to_scripted():
    cfg = compose_config("base-parallel", [])
    assert cfg["engine"]["name"] == "scripted" and cfg["agent_proxy"]["use_parallel_rollout"] is True
    with pytest.raises(Exception):
        compose_config("no-such-config", [])
