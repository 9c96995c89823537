"""ragen.viewer: the HTML page of a rollout dump, its command line, and the page in a real browser."""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ragen.rollout.dump import DumpRecord, read_dump, write_dump
from ragen.rollout.types import RolloutResult, StopReason
from ragen.viewer import default_output, render_html, write_viewer
from ragen.viewer.page import PROGRAM_TEXT_CHARS, split_response
from tests.dump_cases import BAD_DUMPS, write_as_version_2, write_bad_dump
from tests.rollout_helpers import (
    custom_envs,
    fault_tag,
    loop_config,
    sequential,
    specs_for,
)

ROOT = Path(__file__).resolve().parents[1]
# the symbols of config/envs.yaml's grid envs, written out here so the test does not read them from the viewer
SOKOBAN = {"#": "wall", "_": "empty", "O": "target", "√": "box-on-target", "X": "box", "P": "player",
           "S": "player-on-target"}
OTHER_VOCAB = {"W": "wall", ".": "empty", "G": "target", "C": "box-on-target", "B": "box", "A": "player",
               "@": "player-on-target"}
FROZEN = {"P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player-in-hole", "√": "player-on-goal"}
TAGS = ["SimpleSokoban", "FrozenLake", "Bandit", "SokobanDifferentGridVocab", "Fault"]


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    groups = [2, 2, 1, 1, 1]
    fault_seed = next(s.seed for s in specs_for(TAGS, groups, 2, custom_envs(Fault=fault_tag())) if s.tag == "Fault")
    specs = specs_for(TAGS, groups, 2, custom_envs(Fault=fault_tag("raise_step", fault_seed=fault_seed)))
    cfg = loop_config()
    trajs = sequential(specs, cfg)
    assert any(t.stop_reason == StopReason.ERROR for t in trajs), "the Fault env was meant to fail"
    return write_dump(tmp_path_factory.mktemp("run") / "dumps", "step_000001", RolloutResult(trajs, specs), cfg,
                      "train", 1)


@pytest.fixture(scope="module")
def records(dump):
    return read_dump(dump)


@pytest.fixture(scope="module")
def page(records) -> str:
    return render_html(records)


class Grids(HTMLParser):
    """Every ``table.grid`` of a page: its attributes -> rows of (data-cell, class); plus the episode rows."""

    def __init__(self):
        super().__init__()
        self.grids: dict[tuple, list[list[tuple[str, str]]]] = {}
        self.rows: dict[int, dict] = {}  # env_id -> the table row's attributes
        self.episodes: dict[int, dict] = {}  # env_id -> the episode section's attributes
        self._grid = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and "grid" in (a.get("class") or "").split():
            key = (int(a["data-env"]), a.get("data-turn"), a.get("data-step"), a.get("data-final"))
            self._grid = self.grids.setdefault(key, [])
        elif tag == "tr" and self._grid is not None:
            self._grid.append([])
        elif tag == "td" and self._grid is not None:
            self._grid[-1].append((a.get("data-cell"), a.get("class") or ""))
        elif tag == "tr" and "data-episode" in a:
            self.rows[int(a["data-episode"])] = a
        elif tag == "details" and "data-episode" in a:
            self.episodes[int(a["data-episode"])] = a

    def handle_endtag(self, tag):
        if tag == "table":
            self._grid = None


def parse(html: str) -> Grids:
    p = Grids()
    p.feed(html)
    return p


def expected(text: str, vocab: dict[str, str]) -> list[list[str]]:
    return [[vocab[ch] for ch in line] for line in text.split("\n")]


def cells(grid) -> list[list[str]]:
    return [[kind for kind, _ in row] for row in grid]


# ----------------------------------------------------------------------------- the page


def test_every_episode_is_in_the_table_and_has_a_section(records, page):
    p = parse(page)
    ids = {r.env_id for r in records}
    assert len(ids) == 14
    assert set(p.rows) == ids and set(p.episodes) == ids
    for r in records:
        assert p.rows[r.env_id]["data-tag"] == r.spec.tag
        assert p.rows[r.env_id]["data-stop"] == r.trajectory.stop_reason.value
        assert p.episodes[r.env_id]["data-success"] == ("yes" if r.trajectory.success else "no")
        assert f'id="ep-{r.env_id}"' in page
    assert "<script src" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


@pytest.mark.parametrize("tag, vocab", [("SimpleSokoban", SOKOBAN), ("SokobanDifferentGridVocab", OTHER_VOCAB),
                                        ("FrozenLake", FROZEN)])
def test_grid_cells_match_the_text_grid(records, page, tag, vocab):
    p = parse(page)
    r = next(r for r in records if r.spec.tag == tag and r.trajectory.turns)
    turn = r.trajectory.turns[0]
    before = p.grids[(r.env_id, "0", "0", None)]
    assert cells(before) == expected(turn.observation, vocab)
    for j, step in enumerate(turn.steps, 1):
        assert cells(p.grids[(r.env_id, "0", str(j), None)]) == expected(step.observation, vocab)
    # the player mark sits where the text has the player, walls and holes are their terrain
    for line, row in zip(turn.observation.split("\n"), before):
        for ch, (kind, cls) in zip(line, row):
            assert ("p" in cls.split()) == ("player" in vocab[ch])
            assert ("b" in cls.split()) == ("box" in vocab[ch])
            if vocab[ch] in ("wall", "hole", "goal", "target"):
                assert f"t-{vocab[ch]}" in cls.split()


def test_sokoban_known_state_positions(records, page):
    """The first Sokoban state: walls, boxes, targets and the player at the text grid's positions."""
    r = next(r for r in records if r.spec.tag == "SimpleSokoban")
    text = r.trajectory.turns[0].observation
    grid = parse(page).grids[(r.env_id, "0", "0", None)]
    where = {kind: {(i, j) for i, row in enumerate(cells(grid)) for j, k in enumerate(row) if k == kind}
             for kind in SOKOBAN.values()}
    for symbol, kind in SOKOBAN.items():
        assert where[kind] == {(i, j) for i, line in enumerate(text.split("\n"))
                               for j, ch in enumerate(line) if ch == symbol}, kind
    assert len(where["player"] | where["player-on-target"]) == 1


def test_text_envs_and_errors(records, page):
    bandit = next(r for r in records if r.spec.tag == "Bandit")
    assert not any(k[0] == bandit.env_id for k in parse(page).grids)  # no grid for a text env
    assert f'<pre class="obs" data-env="{bandit.env_id}" data-turn="0" data-step="0">' in page
    failed = [r for r in records if r.trajectory.stop_reason == StopReason.ERROR]
    assert failed
    for r in failed:
        start = page.index(f'<details class="episode failed" id="ep-{r.env_id}"')
        end = page.find('<details class="episode', start + 1)
        section = page[start:end if end >= 0 else None]
        assert 'class="error-box"' in section
        assert f'<pre class="error">{html.escape(r.trajectory.error)}</pre>' in section
        assert 'class="ep-row failed"' in page


def test_think_and_answer_are_shown_apart_and_malformed_answers_raw(records, page):
    assert split_response("<think>a</think> <answer>Up</answer>") == ("a", "Up")
    assert split_response("<think>Let") is None
    assert split_response("<answer>Up</answer>", think=False) == (None, "Up")
    assert split_response("<think>a</think> junk <answer>Up</answer>") is None
    seen_raw = seen_split = False
    for r in records:
        for turn in r.trajectory.turns:
            text = "<think>" + turn.response  # the prompt's answer prefix, then what the model wrote
            parts = split_response(text)
            if parts is None:
                seen_raw = True
                assert f"<pre>{html.escape(text)}</pre>" in page
            else:
                seen_split = True
                assert f'<pre class="think">{html.escape(parts[0])}</pre>' in page
                assert f'<pre class="answer">{html.escape(parts[1])}</pre>' in page
    assert seen_split and seen_raw
    assert page.count('<details class="prompt">') == sum(len(r.trajectory.turns) for r in records)


def test_each_turn_shows_the_prompt_tokens_it_added_and_the_tokens_it_sampled(dump, records, page, tmp_path):
    for r in records:
        for turn in r.trajectory.turns:
            assert turn.has_prompt_ids and turn.response_ids
            assert f"tokens +{len(turn.prompt_ids)} prompt, {len(turn.response_ids)} sampled</span>" in page
    # a dump without prompt ids (format 2) shows the sampled ones; one without ids shows none
    old = write_as_version_2(dump.read_text().splitlines(), tmp_path / "v2.jsonl")
    old_page = render_html(read_dump(old))
    assert 'class="tokens"' in old_page and " prompt, " not in old_page
    bare = [dataclasses.replace(r, trajectory=dataclasses.replace(r.trajectory, turns=[
        dataclasses.replace(t, response_ids=(), logprobs=None) for t in r.trajectory.turns]))
        for r in read_dump(old)]
    assert 'class="tokens"' not in render_html(bare)


def test_text_is_escaped(records):
    r = records[0]
    evil = "<script>alert(1)</script>&"
    t = r.trajectory
    turns = [dataclasses.replace(t.turns[0], response=f"<think>{evil}</think><answer>{evil}</answer>",
                                 actions=[evil], observation=evil)] + t.turns[1:]
    traj = dataclasses.replace(t, turns=turns, error=evil, tag=evil)
    spec = dataclasses.replace(r.spec, tag=evil)
    msgs = [[{"role": "user", "content": evil}]] + r.messages[1:]
    page = render_html([dataclasses.replace(r, trajectory=traj, spec=spec, messages=msgs)])
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&amp;" in page


def test_large_dump_renders(records):
    """256 episodes x 10 turns: rendered in seconds, every episode collapsed but in the page."""
    r = next(r for r in records if r.spec.tag == "SimpleSokoban" and r.trajectory.turns)
    turns = (r.trajectory.turns * 10)[:10]
    msgs = (r.messages * 10)[:10]
    big = [dataclasses.replace(r, spec=dataclasses.replace(r.spec, env_id=i),
                               trajectory=dataclasses.replace(r.trajectory, env_id=i, turns=turns), messages=msgs,
                               request_seeds=[1] * 10)
           for i in range(256)]
    start = time.perf_counter()
    page = render_html(big)
    assert time.perf_counter() - start < 30
    p = parse(page)
    assert len(p.episodes) == 256 and len(p.rows) == 256
    assert page.count('<details class="episode') == 256 and "<details open" not in page
    assert len({k for k in p.grids if k[2] == "0"}) == 256 * 10


# ----------------------------------------------------------------------------- the curve


def test_curve_from_metrics_beside_the_dump(tmp_path, dump):
    folder = tmp_path / "run"
    folder.mkdir()
    copy = folder / dump.name
    shutil.copy(dump, copy)
    out = write_viewer(copy)
    assert out == folder / "step_000001.html" == default_output(copy)
    assert "<svg" not in out.read_text()
    (folder / "metrics.jsonl").write_text(
        '{"step": 1, "train/reward": 0.5, "val/success": 0.25}\n{"step": 2, "train/reward": 0.75}\n'
        '{"step": 3, "train/reward": 1.0, "val/success": 0.5}\n')
    text = write_viewer(copy).read_text()
    assert re.search(r'<svg class="curve" data-metric="val/success" data-points="2"', text)
    assert re.search(r'<svg class="curve" data-metric="train/reward" data-points="3"', text)
    assert 'data-metric="train/success"' not in text
    # a metrics.jsonl in the folder above the dump's is found too
    sub = folder / "dumps"
    sub.mkdir()
    shutil.copy(dump, sub / dump.name)
    assert 'data-metric="train/reward"' in write_viewer(sub / dump.name).read_text()


def test_the_curve_says_what_reward_and_success_measure(tmp_path, dump):
    """Bandit's reward and success part ways with no word why on the curve alone: beside it the page
    says what the two measure, and how Bandit's differ (a dump with a Bandit tag)."""
    from ragen.env.bandit.config import BanditEnvConfig
    from ragen.viewer.curve import REWARD_AND_SUCCESS

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "train/reward": 0.1, "train/success": 0.5}\n')
    text = write_viewer(dump, tmp_path / "page.html", metrics).read_text()
    curve = text[text.index('<section id="curve">'):]
    curve = curve[: curve.index("</section>")]
    assert 'data-metric="train/success"' in curve
    assert html.escape(REWARD_AND_SUCCESS) in curve
    assert html.escape(BanditEnvConfig().reward_and_success()) in curve
    assert curve.count("Bandit: success is") == 1  # once, however many Bandit episodes


def test_the_maps_have_a_legend(records, page):
    """Each set of map symbols the episodes are drawn with has a legend: each cell as drawn (the
    grids' classes), its symbol and its name; a page without maps has none."""
    legend = page[page.index('<section id="legend">'):]
    legend = legend[: legend.index("</section>")]
    for tags, vocab in (("SimpleSokoban", SOKOBAN), ("FrozenLake", FROZEN), ("SokobanDifferentGridVocab", OTHER_VOCAB)):
        assert f"<p>{tags}</p>" in legend
        for symbol, kind in vocab.items():
            entry = re.search(rf'<td data-cell="{kind}" class="([^"]*)"[^>]*></td></tr></table><code>'
                              rf'{re.escape(html.escape(symbol))}</code> {kind.replace("-", " ")}</li>', legend)
            assert entry, (tags, symbol, kind)
            classes = entry.group(1).split()
            assert ("p" in classes) == ("player" in kind) and ("b" in classes) == ("box" in kind)
    assert "Bandit" not in legend and "Fault" not in legend
    text_only = render_html([r for r in records if r.spec.tag == "Bandit"])
    assert 'id="legend"' not in text_only


def test_the_curve_shows_rounded_numbers():
    """A mean of rewards that cancel is float noise (8.674e-19): shown as 0, and no value in more than
    four significant digits."""
    from ragen.viewer.curve import curve_svg

    svg = curve_svg([{"step": 1, "train/reward": 8.674e-19}, {"step": 2, "train/reward": -0.1},
                     {"step": 3, "train/reward": 1 / 3}, {"step": 4, "train/reward": -1e-17}])
    shown = re.findall(r">([^<>]+)<", svg)
    assert "step 1: 0" in shown and "step 2: -0.1" in shown and "step 3: 0.3333" in shown and "step 4: 0" in shown
    assert not [text for text in shown if "e-" in text], shown
    assert "0.3333" in shown  # the axis' top


# ----------------------------------------------------------------------------- the command line


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "ragen.tools.viewer", *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_cli_writes_the_page(tmp_path, dump):
    out = tmp_path / "page.html"
    res = cli(dump, "-o", out)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    assert 'data-episode="0"' in out.read_text(encoding="utf-8")


def _bad_inputs(tmp_path: Path, dump: Path) -> dict[str, tuple[Path, str]]:
    text = dump.read_text(encoding="utf-8")
    lines = text.split("\n")
    truncated = tmp_path / "truncated.jsonl"
    truncated.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2], encoding="utf-8")
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"a": 1}\n', encoding="utf-8")
    return {"missing": (tmp_path / "nope.jsonl", "no such file"),
            "truncated": (truncated, "line 3"),
            "foreign": (foreign, "line 1")}


@pytest.mark.parametrize("case", ["missing", "truncated", "foreign"])
def test_cli_bad_dump(tmp_path, dump, case):
    path, where = _bad_inputs(tmp_path, dump)[case]
    res = cli(path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.startswith("error: ") and str(path) in res.stderr and where in res.stderr
    assert "Traceback" not in res.stderr
    assert not default_output(path).exists()


@pytest.mark.parametrize("case", sorted(BAD_DUMPS))
def test_cli_wrong_typed_deep_or_repeated_fields(tmp_path, dump, case):
    bad, message = write_bad_dump(dump, case, tmp_path / "bad.jsonl")
    res = cli(bad, "-o", tmp_path / "page.html")
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.startswith(f"error: {bad} {message}"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "page.html").exists()


def test_cli_bad_metrics(tmp_path, dump):
    bad = tmp_path / "metrics.txt"
    bad.write_text('{"step": 1, "train/reward": 1}\nnot json\n{"step": 3}\n')
    res = cli(dump, "-o", tmp_path / "x.html", "--metrics", bad)
    assert res.returncode == 2 and str(bad) in res.stderr and "line 2" in res.stderr
    assert "Traceback" not in res.stderr
    res = cli(dump, "-o", tmp_path / "x.html", "--metrics", tmp_path / "absent.jsonl")
    assert res.returncode == 2 and "absent.jsonl" in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "foreign.jsonl").write_text('[1, 2]\n')
    res = cli(dump, "-o", tmp_path / "x.html", "--metrics", tmp_path / "foreign.jsonl")
    assert res.returncode == 2 and "foreign.jsonl line 1" in res.stderr


# ----------------------------------------------------------------------------- a dump is data: env types

ZEN = "Beautiful is better than ugly"  # what importing `this` prints


def _with_env_type(dump: Path, out: Path, env_type: str, env_config: dict, config_type=None) -> Path:
    """The dump with its first line naming another env type (what a hostile dump would say)."""
    lines = dump.read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[0])
    row["spec"].update(env_type=env_type, env_config=env_config, config_type=config_type)
    out.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n", encoding="utf-8")
    return out


@pytest.mark.timeout(300)
def test_a_crafted_env_type_is_never_imported_by_the_viewer(tmp_path, dump):
    touched = tmp_path / "touched_by_popen"
    popen = _with_env_type(dump, tmp_path / "popen.jsonl", "subprocess:Popen", {"touch": 1, str(touched): 2})
    zen = _with_env_type(dump, tmp_path / "zen.jsonl", "this:X", {})
    for path, name in ((popen, "subprocess:Popen"), (zen, "this:X")):
        res = cli(path, "-o", tmp_path / "page.html")
        assert res.returncode == 0, res.stderr  # the page is drawn, that env's grid with the default symbols
        assert ZEN not in res.stdout and f"env type '{name}'" in res.stderr
        assert f"--allow-env-type {name}" in res.stderr
        assert 'data-episode="0"' in (tmp_path / "page.html").read_text(encoding="utf-8")
    assert not touched.exists()
    # the function API imports nothing either, unless the user's setup names the type
    code = ("import sys; from ragen.viewer import write_viewer; from ragen.env.allowed import allowed_env_types; "
            "allow = sys.argv[3:]; write_viewer(sys.argv[1], sys.argv[2], env_types=allowed_env_types(allow=allow)); "
            "print('imported' if 'tests.custom_env_example' in sys.modules else 'not imported', "
            "'this' in sys.modules)")
    mine = _with_env_type(dump, tmp_path / "mine.jsonl", "tests.custom_env_example:MyEnv", {"limit": 2})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for path, allow, expected in ((zen, [], "not imported False"), (mine, [], "not imported False"),
                                  (mine, ["tests.custom_env_example:MyEnv"], "imported False")):
        res = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "p.html"), *allow],
                             capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == expected, res.stdout + res.stderr


# ----------------------------------------------------------------------------- a real browser

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _find_browser() -> str | None:
    return next((p for name in BROWSERS if (p := shutil.which(name))), None)


@pytest.fixture(scope="session")
def browser() -> str:
    found = _find_browser()
    if found is None and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        # A fresh machine may have no package lists yet: update once when the install fails.
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "install", "-y", "chromium"], ["apt-get", "update"],
                        ["apt-get", "install", "-y", "chromium"]):
            try:
                subprocess.run(command, check=False, capture_output=True, timeout=300, env=env)
            except subprocess.TimeoutExpired:
                break
            found = _find_browser()
            if found is not None:
                break
    if found is None:
        pytest.skip(f"no headless browser on PATH (looked for {', '.join(BROWSERS)}; "
                    "install Debian's chromium: apt-get install -y chromium)")
    return found


def _chromium(browser: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(1200)  # the first may install chromium
def test_browser_runs_the_page_and_filters_by_hash(browser, tmp_path, records, dump):
    out = write_viewer(dump, tmp_path / "page.html")
    res = _chromium(browser, tmp_path, "--dump-dom", out.as_uri() + "#tag=FrozenLake")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert re.search(r'<body[^>]*data-ready="1"', dom), dom[:2000]
    p = parse(dom)
    assert set(p.rows) == set(p.episodes) == {r.env_id for r in records}
    for r in records:
        hidden = r.spec.tag != "FrozenLake"
        assert ("hidden" in p.rows[r.env_id]) == hidden, (r.spec.tag, p.rows[r.env_id])
        assert ("hidden" in p.episodes[r.env_id]) == hidden
    shown = sum(r.spec.tag == "FrozenLake" for r in records)
    assert f"{shown} of {len(records)} shown" in dom
    soko = next(r for r in records if r.spec.tag == "SimpleSokoban")
    assert cells(p.grids[(soko.env_id, "0", "0", None)]) == expected(soko.trajectory.turns[0].observation, SOKOBAN)
    # two filters at once, one of them a stop reason
    res = _chromium(browser, tmp_path, "--dump-dom", out.as_uri() + "#stop=error&success=no")
    p = parse(res.stdout)
    visible = {i for i, a in p.rows.items() if "hidden" not in a}
    assert visible == {r.env_id for r in records if r.trajectory.stop_reason == StopReason.ERROR}


@pytest.mark.timeout(1200)  # the first may install chromium
def test_browser_screenshot(browser, tmp_path, dump):
    out = write_viewer(dump, tmp_path / "page.html")
    shot = tmp_path / "page.png"
    res = _chromium(browser, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000", out.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000, shot.stat().st_size


@pytest.mark.parametrize("fmt", ["grid_coord", "coord"])
def test_observation_formats(fmt):
    envs = custom_envs()
    envs["SimpleSokoban"]["env_config"] = {**(envs["SimpleSokoban"].get("env_config") or {}),
                                           "observation_format": fmt}
    specs = specs_for(["SimpleSokoban"], [1], 1, envs)
    cfg = loop_config(max_turn=1)
    trajs = sequential(specs, cfg)
    page = render_html([_record(t, s, cfg) for t, s in zip(trajs, specs)])
    obs = trajs[0].turns[0].observation
    grids = parse(page).grids
    if fmt == "grid_coord":
        assert obs.startswith("Coordinates: \n") and "Grid Map: \n" in obs
        assert cells(grids[(0, "0", "0", None)]) == expected(obs.split("Grid Map: \n")[1], SOKOBAN)
        assert f'<pre class="coords">{html.escape(obs.split(chr(10) + "Grid Map:")[0])}</pre>' in page
    else:
        assert not grids  # coordinates only: shown as text
        assert f'<pre class="obs" data-env="0" data-turn="0" data-step="0">{html.escape(obs)}</pre>' in page


def _record(traj, spec, cfg):
    return DumpRecord(split="train", step=1, spec=spec, loop=cfg, trajectory=traj,
                      messages=[[] for _ in traj.turns], request_seeds=[0] * len(traj.turns), line=1)


def test_default_output_names():
    assert default_output("/a/step_000001.jsonl") == Path("/a/step_000001.html")
    assert default_output("/a/val_step_000002.jsonl.gz") == Path("/a/val_step_000002.html")


def test_an_agent_episodes_program_output_is_shown_escaped_collapsed_and_bounded(records, page):
    evil = "<script>alert(1)</script>&"
    r = records[0]
    long_err = "e" * (PROGRAM_TEXT_CHARS + 10) + "END"
    program = {"info": {"answer": evil, "steps": 2}, "traceback": f"Traceback ...\nRuntimeError: {evil}\n",
               "stdout": f"printed {evil}\n", "stderr": long_err}
    shown = render_html([dataclasses.replace(r, trajectory=dataclasses.replace(r.trajectory, program=program))])
    assert "<script>alert" not in shown
    escaped = html.escape(evil)
    section = shown[shown.index('<div class="program">'):]
    for name, text in (("traceback", f"RuntimeError: {escaped}"), ("stdout", f"printed {escaped}"),
                       ("info", html.escape(f'"answer": "{evil}"'))):
        part = section[section.index(f'<details class="program-{name}">'):]
        assert text in part[:part.index("</details>")], name
    # long text: its end, and how much was cut; every part collapsed
    part = section[section.index('<details class="program-stderr">'):]
    assert f"the last {PROGRAM_TEXT_CHARS} of {len(long_err)} characters" in part and "eEND</pre>" in part
    assert part.index("</details>") < PROGRAM_TEXT_CHARS + 500 and "<details open" not in shown
    # an env's episode has none
    assert 'class="program"' not in page
