"""The env checker: runs every check on an env and says what would break the
rollout engine, and how to fix it.

- ``check_env(env_type, env_config, config_type, seeds)`` builds the env through
  ``ragen.env.make_env`` (as a worker does), runs every check and returns a
  ``CheckReport`` (``ragen.env.check.report``) plus reset/step timings.
- An *episode* here is ``reset(seed)`` then up to ``max_steps`` steps of a fixed
  action sequence drawn from the seed (ids of ``ACTION_LOOKUP`` for a discrete
  env; for a language env, short answer texts and the examples its first
  observation shows: a quoted text or a bracketed move, such as TextArena's
  ``'[2 1 4 5]'``); episodes are compared as plain data (numpy values converted).

The checks, each one an invariant of the engine (see DESIGN.md): the env builds
as a rollout's config read and its workers build it (its config, and the tools
it declares, checked as ``train.py`` checks them); what it needs outside itself
answers (``preflight``: the search env's retrieval server);
``ACTION_LOOKUP`` is a non-empty ``{int: str}``; ``reset`` returns text and
``step`` ``(str, float-like, bool, dict)`` with the ``info`` keys the loop and
metrics read; an invalid action does not raise; the same seed gives the same
episode on fresh and on reused instances; different seeds give different
episodes (warning only; where every seed shows the same first observation, the
episodes are compared after their steps, and after each example alone); the
global ``random``/``np.random`` generators are untouched; two instances stepped in turn behave as each one alone, and no class
attribute or module global changes; the env config and the env pickle; and how
long ``reset`` and ``step`` take.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import pickle
import random
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np

from ragen.env import make_env, make_env_config, resolve_env_type
from ragen.env.check.report import CheckReport
from ragen.llm.tool_calls import declared_tools
from ragen.pickling import describe_unpicklable

logger = logging.getLogger(__name__)

__all__ = ["check_env"]

INFO_KEYS = ("action_is_valid", "action_is_effective", "success")
# answers for language envs (no ACTION_LOOKUP): well formed, wrong and garbage
TEXT_ACTIONS = ("1 + 2", "(3 * 4) - 5", "7", "2 * 3 + 4", "Up", "hello")
# an example answer an observation shows: a quoted text, or a bracketed move (TextArena's "[2 1 4 5]")
_EXAMPLE = re.compile(r"(?<!\w)'([^'\n]{1,40})'(?!\w)|(?<!\w)\"([^\"\n]{1,40})\"|`([^`\n]{1,40})`"
                      r"|(\w*\[[^\[\]\n]{1,40}\])")
MAX_EXAMPLES = 8
INVALID_DISCRETE = (None, "not an action", -1, 10**6, 2.5, "")
INVALID_TEXT = (None, "", "@@@ not an answer @@@", 12345)
SLOW_RESET_S = 1.0
SLOW_STEP_S = 0.1
_MUTABLE = (list, dict, set, bytearray, np.ndarray)
_RNG_FIX = (
    "give each env its own generator, created in reset from the seed: "
    "`self.seed, self.np_random = ragen.env.base.make_rng(seed)` (or np.random.default_rng(seed)), "
    "and draw only from self.np_random; never call np.random.<fn>, np.random.seed, random.<fn> "
    "or random.seed, and do not use time or os.urandom as a source of randomness"
)


def _short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _canon(x: Any) -> Any:
    """Plain, comparable data: numpy arrays and scalars to lists and Python numbers."""
    if isinstance(x, np.ndarray):
        return ["ndarray", x.dtype.str, list(x.shape), x.tolist()]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Mapping):
        return {repr(k): _canon(v) for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    return x


def _same(a: Any, b: Any) -> bool:
    return repr(_canon(a)) == repr(_canon(b))


def _exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ----- running episodes ---------------------------------------------------------

class _Timer:
    def __init__(self) -> None:
        self.reset: list[float] = []
        self.step: list[float] = []

    def call(self, kind: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            getattr(self, kind).append(time.perf_counter() - t0)


def _lookup(env: Any) -> dict | None:
    lookup = getattr(env, "ACTION_LOOKUP", None)
    return lookup if isinstance(lookup, Mapping) and lookup else None


def _examples(observation: Any) -> list[str]:
    """The example answers a language env's first observation shows, in order, at most ``MAX_EXAMPLES``."""
    if not isinstance(observation, str):
        return []
    found = (next(g for g in m.groups() if g is not None).strip() for m in _EXAMPLE.finditer(observation))
    return list(dict.fromkeys(e for e in found if e))[:MAX_EXAMPLES]


def _choices(env: Any, examples: Sequence[str]) -> list[Any]:
    """The actions episodes draw from: the ids of ``ACTION_LOOKUP``, else answer texts and ``examples``."""
    lookup = _lookup(env)
    return list(lookup) if lookup else [*TEXT_ACTIONS, *examples]


def _actions(choices: Sequence[Any], seed: int, n: int) -> list[Any]:
    """The fixed action sequence of an episode, a function of the seed only."""
    rng = random.Random(f"ragen.env.check:{seed}")
    return [rng.choice(choices) for _ in range(n)]


def _is_done(out: Any) -> bool:
    """The done flag of a step's return, tolerating wrong shapes (gymnasium's 5-tuple)."""
    try:
        if isinstance(out, tuple) and len(out) == 4:
            return bool(out[2])
        if isinstance(out, tuple) and len(out) == 5:
            return bool(out[2]) or bool(out[3])
    except Exception:
        return True
    return False


class _Episode:
    """An env and its trace, stepped one call at a time (so two can interleave)."""

    def __init__(self, env: Any, seed: int, actions: list[Any], timer: _Timer) -> None:
        self.env, self.seed, self.actions, self.timer = env, seed, actions, timer
        self.trace: list[Any] = []
        self.done = False

    def reset(self) -> None:
        self.trace.append(self.timer.call("reset", self.env.reset, seed=self.seed))

    def step(self) -> None:
        i = len(self.trace) - 1
        if self.done or i >= len(self.actions):
            self.done = True
            return
        out = self.timer.call("step", self.env.step, self.actions[i])
        self.trace.append(out)
        self.done = _is_done(out)

    def run(self) -> list[Any]:
        self.reset()
        while not self.done:
            self.step()
        return self.trace


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if not _same(x, y):
            where = "reset" if i == 0 else f"step {i}"
            if i > 0 and isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y) == 4:
                names = ("observation", "reward", "done", "info")
                part = next((k for k in range(4) if not _same(x[k], y[k])), 0)
                return f"{where} {names[part]}: {_short(x[part])} vs {_short(y[part])}"
            return f"{where}: {_short(x)} vs {_short(y)}"
    return f"episode length {len(a) - 1} vs {len(b) - 1} steps"


# ----- shared state --------------------------------------------------------------

def _shared_containers(env: Any) -> dict[str, Any]:
    """Mutable class attributes and module globals an env could share between instances."""
    out: dict[str, Any] = {}
    for cls in type(env).__mro__:
        if cls is object:
            continue
        for name, value in vars(cls).items():
            if not name.startswith("__") and isinstance(value, _MUTABLE):
                out.setdefault(f"class attribute {cls.__name__}.{name}", value)
    module = sys.modules.get(type(env).__module__)
    if module is not None:
        for name, value in vars(module).items():
            if not name.startswith("__") and isinstance(value, _MUTABLE):
                out[f"module global {module.__name__}.{name}"] = value
    return out


def _snapshot(containers: dict[str, Any]) -> dict[str, str]:
    snap = {}
    for name, value in containers.items():
        try:
            snap[name] = repr(_canon(copy.deepcopy(value)))
        except Exception:  # an uncopyable container: compare what repr shows
            snap[name] = repr(value)
    return snap


def _rng_state() -> tuple[Any, Any]:
    return np.random.get_state(), random.getstate()


def _rng_changed(before: tuple[Any, Any]) -> list[str]:
    np_before, py_before = before
    np_after, py_after = _rng_state()
    changed = []
    if not (np_before[0] == np_after[0] and np.array_equal(np_before[1], np_after[1])
            and tuple(np_before[2:]) == tuple(np_after[2:])):
        changed.append("numpy's global generator (np.random.*)")
    if py_before != py_after:
        changed.append("Python's global generator (random.*)")
    return changed


def _clear_memos(env: Any) -> None:
    """Forget lru_cache memos of the env's package, so a second run regenerates
    (a memo would hide a non-deterministic generator)."""
    module = type(env).__module__
    package = module.rpartition(".")[0] or module
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == module or name.startswith(package + ".")):
            continue
        for value in list(vars(mod).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and hasattr(value, "cache_info"):
                try:
                    clear()
                except Exception:
                    logger.debug("could not clear %r", value, exc_info=True)


# ----- the checks ---------------------------------------------------------------

def check_env(
    env_type: str,
    env_config: Mapping[str, Any] | Any | None = None,
    config_type: str | None = None,
    seeds: int | Sequence[int] = 5,
    max_steps: int = 20,
) -> CheckReport:
    """Run every check on ``env_type`` built from ``env_config``; see the module docstring."""
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list:
        raise ValueError("seeds: give at least one seed")
    report = CheckReport(env_type, env_config, config_type, seed_list)
    timer = _Timer()
    try:
        _run_checks(report, timer, env_type, env_config, config_type, seed_list, max_steps)
    finally:
        for kind in ("reset", "step"):
            samples = getattr(timer, kind)
            if samples:
                report.timings[f"{kind}_mean_ms"] = 1000 * float(np.mean(samples))
                report.timings[f"{kind}_p95_ms"] = 1000 * float(np.percentile(samples, 95))
                report.timings[f"{kind}_n"] = float(len(samples))
    _timing(report)
    return report


def _run_checks(report: CheckReport, timer: _Timer, env_type: str, env_config: Any, config_type: str | None,
                seeds: list[int], max_steps: int) -> None:
    # build ------------------------------------------------------------------------
    try:
        env_cls, config_cls = resolve_env_type(env_type, config_type)
        config = make_env_config(env_type, env_config, config_type)
        tools = declared_tools(config, "env_config")  # as train.py's config read checks them
        env = make_env(env_type, env_config, config_type)
    except Exception as exc:
        report.add("build", "fail", f"building {env_type!r} as train.py and its workers do raised {_exc(exc)}",
                   "the message above names the key; give a registered name or 'package.module:EnvClass', "
                   "and env_config keys that the config class accepts")
        return
    config_name = type(config).__name__ if config is not None else "no config"
    report.add("build", "pass", f"{env_cls.__name__} from {config_name}"
               + (f", {len(tools)} tools: {', '.join(t['function']['name'] for t in tools)}" if tools else ""))
    _check_preflight(report, env)

    def fresh() -> Any:
        return make_env(env_type, env_config, config_type)

    # reset and step types --------------------------------------------------------
    before_rng = _rng_state()
    shared = _shared_containers(env)
    shared_before = _snapshot(shared)
    try:
        obs = timer.call("reset", env.reset, seed=seeds[0])
    except TypeError as exc:
        report.add("reset", "fail", f"reset(seed={seeds[0]}) raised {_exc(exc)}",
                   "accept the seed as a keyword: def reset(self, seed=None, **kwargs) -> str")
        _skip_rest(report, "reset failed")
        return
    except Exception as exc:
        report.add("reset", "fail", f"reset(seed={seeds[0]}) raised {_exc(exc)}",
                   "reset must work for any integer seed; the engine gives each env group its own seed")
        _skip_rest(report, "reset failed")
        return
    # ACTION_LOOKUP is read after a reset, as the loop does: RAGEN's Bandit sets it there
    discrete = _check_action_lookup(report, env)
    examples = [] if discrete else _examples(obs)
    choices = _choices(env, examples)
    if isinstance(obs, str):
        report.add("reset", "pass", f"returns text ({len(obs)} chars)")
    else:
        report.add("reset", "fail", f"reset returned {type(obs).__name__} {_short(obs)}, not str",
                   "return the observation text the agent sees, e.g. `return self.render()` "
                   "(gymnasium's (obs, info) pair is not the RAGEN interface)")
    _check_step(report, env, _actions(choices, seeds[0], 1)[0], timer)
    _check_invalid_actions(report, env, seeds[0], discrete, timer)

    # determinism, seeds, global generators ----------------------------------------
    traces: dict[int, list[Any]] = {}
    problems: list[str] = []
    try:
        for seed in seeds:
            actions = _actions(choices, seed, max_steps)
            first = _Episode(fresh(), seed, actions, timer)
            first.run()
            _clear_memos(env)
            second = _Episode(fresh(), seed, actions, timer).run()
            again = _Episode(first.env, seed, actions, timer).run()  # the same instance, reused
            traces[seed] = first.trace
            if not _same(first.trace, second):
                problems.append(f"seed {seed}: two fresh instances differ at {_first_difference(first.trace, second)}")
            elif not _same(first.trace, again):
                problems.append(f"seed {seed}: a reused instance differs from a fresh one at "
                                f"{_first_difference(first.trace, again)}")
    except Exception as exc:
        report.add("determinism", "fail", f"an episode raised {_exc(exc)}",
                   "reset and step must not raise for the seeds and actions of a rollout")
        _skip_rest(report, "an episode raised", keep=("pickle_config", "pickle_env"))
        _check_pickle(report, env_config, config, fresh, seeds[0], timer, compare=False)
        return
    rng_changed = _rng_changed(before_rng)
    if problems:
        cause = " (the global generator is used: see global_rng)" if rng_changed else ""
        report.add("determinism", "fail", "; ".join(problems[:3]) + cause,
                   "the same seed must give the same episode, on a fresh and on a reused instance: "
                   "reset every piece of episode state in reset, and " + _RNG_FIX)
    else:
        report.add("determinism", "pass", f"same seed, same episode on fresh and reused instances "
                                          f"({len(seeds)} seeds)")
    if rng_changed:
        report.add("global_rng", "fail", f"reset/step changed {' and '.join(rng_changed)}: instances in threads "
                                         "of one worker disturb each other, and the engine's results depend on "
                                         "the order in which envs are stepped", _RNG_FIX)
    else:
        report.add("global_rng", "pass", "the global random and np.random generators are untouched")

    _check_seeds_differ(report, traces, fresh, choices, examples, max_steps, timer)

    # isolation ---------------------------------------------------------------------
    isolation_failed = _check_isolation(report, fresh, choices, seeds, max_steps, timer, bool(problems))
    changed = [name for name, snap in _snapshot(shared).items() if shared_before.get(name) != snap]
    if changed:
        status = "fail" if (isolation_failed or problems) else "warn"
        report.add("shared_state", status, f"{', '.join(changed)} changed during reset/step: it is shared by "
                                           "every instance in a worker process",
                   "keep episode state on the instance (assign it in __init__ or reset: self.x = []); "
                   "a class attribute or module global is shared by all instances"
                   + ("" if status == "fail" else "; fine only if it is a cache of pure results"))
    else:
        report.add("shared_state", "pass", f"no class attribute or module global changed "
                                           f"({len(shared)} mutable ones watched)")
    culprits = changed + ([f"{' and '.join(rng_changed)} (see global_rng)"] if rng_changed else [])
    if isolation_failed and culprits:
        report["isolation"].fix += f" (culprit: {', '.join(culprits)})"

    _check_pickle(report, env_config, config, fresh, seeds[0], timer, compare=not problems)


def _skip_rest(report: CheckReport, why: str, keep: Sequence[str] = ()) -> None:
    for name in ("action_lookup", "step", "info_keys", "invalid_action", "determinism", "global_rng", "seeds_differ", "isolation",
                 "shared_state", "pickle_config", "pickle_env"):
        if name not in keep and all(r.name != name for r in report.results):
            report.add(name, "skip", f"not run: {why}")


def _check_preflight(report: CheckReport, env: Any) -> None:
    """What the env says of what it needs outside itself (``BaseEnv.preflight``)."""
    preflight = getattr(env, "preflight", None)
    if not callable(preflight):
        report.add("preflight", "pass", "the env names nothing it needs outside itself (it has no preflight)")
        return
    try:
        why = preflight()
    except Exception as exc:  # an env's own code: whatever it raises is the finding
        why = f"preflight() raised {_exc(exc)}"
    if why is None:
        report.add("preflight", "pass", "what the env needs outside itself answers")
    else:
        report.add("preflight", "fail", str(why),
                   "start what it names (or point env_config at it) before a rollout: until then every env of "
                   "this kind ends in error")


def _check_seeds_differ(report: CheckReport, traces: dict[int, list[Any]], fresh: Callable[[], Any],
                        choices: list[Any], examples: list[str], max_steps: int, timer: _Timer) -> None:
    seeds = list(traces)
    if len(seeds) < 2:
        report.add("seeds_differ", "skip", "one seed only")
        return
    distinct = {repr(_canon(t[0])) for t in traces.values()}  # first observations
    how = "initial states"
    if len(distinct) == 1:  # one look, maybe a hidden state (Mastermind's code): compare what steps show
        runs = [_actions(choices, seeds[0], max_steps), *([e] for e in examples)]
        distinct = {repr(_canon([_Episode(fresh(), seed, actions, timer).run() for actions in runs]))
                    for seed in seeds}
        how = "episodes (one first observation; they differ after a step)"
    if len(distinct) == 1:
        report.add("seeds_differ", "warn", f"all {len(seeds)} seeds give the same episode"
                   + (f", also after each of the examples the first observation shows ({', '.join(examples)})"
                      if examples else ""),
                   "derive the initial state from the reset seed (self.np_random = np.random.default_rng(seed)); "
                   "otherwise every env group plays the same episode")
    else:
        report.add("seeds_differ", "pass", f"{len(distinct)} distinct {how} from {len(seeds)} seeds")


def _check_action_lookup(report: CheckReport, env: Any) -> bool:
    from ragen.env.base import BaseDiscreteActionEnv, BaseLanguageBasedEnv

    lookup = getattr(env, "ACTION_LOOKUP", None)
    is_discrete = isinstance(env, BaseDiscreteActionEnv) or lookup is not None
    if not is_discrete or (isinstance(env, BaseLanguageBasedEnv) and not lookup):
        report.add("action_lookup", "pass", "language env: the answer text is the action")
        return False
    fix = ("set ACTION_LOOKUP to a non-empty dict of integer action ids to distinct action names, "
           "e.g. {1: 'Up', 2: 'Down'}; the agent loop lists the names in prompts and maps answers back to ids")
    if not isinstance(lookup, Mapping) or not lookup:
        report.add("action_lookup", "fail", f"ACTION_LOOKUP is {_short(lookup)}: the agent cannot name any action",
                   fix + " (or derive from BaseLanguageBasedEnv if the answer text is the action)")
        return False
    bad_ids = [k for k in lookup if isinstance(k, bool) or not isinstance(k, numbers.Integral)]
    bad_names = [v for v in lookup.values() if not isinstance(v, str) or not v.strip()]
    folded = [str(v).lower() for v in lookup.values()]
    dupes = sorted({v for v in folded if folded.count(v) > 1})
    if bad_ids or bad_names or dupes:
        parts = []
        if bad_ids:
            parts.append(f"ids that are not integers: {bad_ids}")
        if bad_names:
            parts.append(f"names that are not non-empty strings: {bad_names}")
        if dupes:
            parts.append(f"names equal ignoring case: {dupes}")
        report.add("action_lookup", "fail", "ACTION_LOOKUP has " + "; ".join(parts), fix)
        return True
    report.add("action_lookup", "pass", f"{len(lookup)} actions: {', '.join(map(str, lookup.values()))}")
    return True


def _check_step(report: CheckReport, env: Any, action: Any, timer: _Timer) -> bool:
    try:
        out = timer.call("step", env.step, action)
    except Exception as exc:
        report.add("step", "fail", f"step({action!r}) after reset raised {_exc(exc)}",
                   "step must accept every action of ACTION_LOOKUP (or any answer text) after reset")
        report.add("info_keys", "skip", "not run: step failed")
        return False
    problems, fixes = [], []
    if not isinstance(out, tuple) or len(out) != 4:
        n = len(out) if isinstance(out, tuple) else None
        problems.append(f"step returned {type(out).__name__}" + (f" of {n} items" if n is not None else "")
                        + f" {_short(out)}")
        fixes.append("return a 4-tuple (observation: str, reward: float, done: bool, info: dict)"
                     + ("; merge gymnasium's terminated and truncated into done" if n == 5 else ""))
        report.add("step", "fail", "; ".join(problems), "; ".join(fixes))
        report.add("info_keys", "skip", "not run: step did not return a 4-tuple")
        return False
    obs, reward, done, info = out
    if not isinstance(obs, str):
        problems.append(f"observation is {type(obs).__name__} {_short(obs, 40)}, not str")
        fixes.append("return the observation text (e.g. self.render())")
    if isinstance(reward, (str, bytes)) or not isinstance(reward, numbers.Real):
        problems.append(f"reward is {type(reward).__name__} {_short(reward, 40)}, not a number")
        fixes.append("return the reward as a float")
    elif not math.isfinite(reward):
        problems.append(f"reward is {reward}, not a finite number")
        fixes.append("return a finite reward: the rollout ends an env that returns NaN or inf in error")
    if not isinstance(done, (bool, np.bool_)):
        problems.append(f"done is {type(done).__name__} {_short(done, 40)}, not bool")
        fixes.append("return done as a bool (e.g. bool(self._done))")
    if not isinstance(info, dict):
        problems.append(f"info is {type(info).__name__} {_short(info, 40)}, not dict")
        fixes.append(f"return info as a dict with keys {list(INFO_KEYS)}")
    if problems:
        report.add("step", "fail", "; ".join(problems), "; ".join(fixes))
    else:
        report.add("step", "pass", "returns (str, float, bool, dict)")
    if isinstance(info, dict):
        missing = [k for k in INFO_KEYS if k not in info]
        if missing:
            report.add("info_keys", "fail", f"info lacks {missing} (has {sorted(map(str, info))})",
                       "put action_is_valid, action_is_effective and success (bools) in every step's info: "
                       "the loop and the rollout metrics read them")
        else:
            report.add("info_keys", "pass", f"info has {list(INFO_KEYS)}")
    else:
        report.add("info_keys", "skip", "not run: info is not a dict")
    return not problems


def _check_invalid_actions(report: CheckReport, env: Any, seed: int, discrete: bool, timer: _Timer) -> None:
    raised, accepted = [], []
    for action in (INVALID_DISCRETE if discrete else INVALID_TEXT):
        try:
            timer.call("reset", env.reset, seed=seed)
            out = timer.call("step", env.step, action)
        except Exception as exc:
            raised.append(f"step({action!r}) raised {_exc(exc)}")
            continue
        info = out[3] if isinstance(out, tuple) and len(out) == 4 and isinstance(out[3], dict) else {}
        if discrete and info.get("action_is_valid") is True:
            accepted.append(repr(action))
    if raised and discrete:
        # The rollout loop steps a discrete env only with ids of its ACTION_LOOKUP
        # (unknown names are dropped before step), as RAGEN's does; RAGEN's own
        # envs raise here. Worth knowing, not a reason to refuse the env.
        report.add("invalid_action", "warn", "; ".join(raised[:3]),
                   "ragen's loop never passes such an action to a discrete env, so rollouts are safe; a direct "
                   "caller of step would see the exception: return the unchanged observation with "
                   "info['action_is_valid'] = False instead (see BaseDiscreteActionEnv.is_valid_action)")
    elif raised:
        report.add("invalid_action", "fail", "; ".join(raised[:3]),
                   "a malformed answer (the raw text, for a language env) must not raise: return the "
                   "unchanged observation, config.invalid_act_score as reward, done unchanged and "
                   "info['action_is_valid'] = False")
    elif accepted:
        report.add("invalid_action", "warn", f"invalid actions {', '.join(accepted)} reported action_is_valid=True",
                   "set info['action_is_valid'] = False for an action that is not an id of ACTION_LOOKUP")
    else:
        report.add("invalid_action", "pass", "invalid actions are refused without raising")


def _check_isolation(report: CheckReport, fresh: Callable[[], Any], choices: list[Any], seeds: list[int],
                     max_steps: int, timer: _Timer, nondeterministic: bool) -> bool:
    if nondeterministic:
        report.add("isolation", "skip", "not run: the env is not deterministic (see determinism)")
        return False
    s1 = seeds[0]
    s2 = seeds[1] if len(seeds) > 1 else seeds[0] + 1
    a1, a2 = _actions(choices, s1, max_steps), _actions(choices, s2, max_steps)
    try:
        alone1 = _Episode(fresh(), s1, a1, timer).run()
        alone2 = _Episode(fresh(), s2, a2, timer).run()
        x, y = _Episode(fresh(), s1, a1, timer), _Episode(fresh(), s2, a2, timer)
        x.reset()
        y.reset()
        while not (x.done and y.done):
            x.step()
            y.step()
    except Exception as exc:
        report.add("isolation", "fail", f"stepping two instances in turn raised {_exc(exc)}",
                   "keep all episode state on the instance; class attributes and module globals are shared")
        return True
    bad = []
    if not _same(alone1, x.trace):
        bad.append(f"seed {s1}: {_first_difference(alone1, x.trace)}")
    if not _same(alone2, y.trace):
        bad.append(f"seed {s2}: {_first_difference(alone2, y.trace)}")
    if bad:
        report.add("isolation", "fail", "two instances stepped in turn differ from each alone: " + "; ".join(bad),
                   "instances share state: keep all episode state on the instance (assign it in __init__ or "
                   "reset); class attributes and module globals are shared by every env in a worker")
        return True
    report.add("isolation", "pass", "two instances stepped in turn behave as each alone")
    return False


def _check_pickle(report: CheckReport, env_config: Any, config: Any, fresh: Callable[[], Any], seed: int,
                  timer: _Timer, compare: bool = True) -> None:
    """``compare``: also check that an unpickled env resets as the original does
    (meaningless for a non-deterministic env)."""
    problems = [p for p in (describe_unpicklable(env_config, "env_config"),
                            describe_unpicklable(config, type(config).__name__)) if p]
    if problems:
        report.add("pickle_config", "fail", "does not pickle: " + "; ".join(problems),
                   "env_config must be plain data (numbers, strings, lists, dicts): it travels to worker "
                   "processes in every EnvSpec; build locks, clients and callables inside the env instead")
    else:
        report.add("pickle_config", "pass", "env_config and the config object pickle")
    env = None
    try:
        env = fresh()
        obs = timer.call("reset", env.reset, seed=seed)
        blob = pickle.dumps(env)
    except Exception as exc:
        where = (describe_unpicklable(env, type(env).__name__) if env is not None else None) or _exc(exc)
        report.add("pickle_env", "fail", f"the env does not pickle after reset: {where}",
                   "keep only picklable data on the instance: create locks, files, sockets and lambdas lazily "
                   "(or drop them in __getstate__ and rebuild them in __setstate__), and use module-level "
                   "functions or methods instead of lambdas; process backends and copy.deepcopy need it")
        return
    try:
        clone = pickle.loads(blob)
        again = clone.reset(seed=seed)
    except Exception as exc:
        report.add("pickle_env", "fail", f"an unpickled env fails on reset: {_exc(exc)}",
                   "make __setstate__ (or the pickled attributes) restore a working env")
        return
    if compare and not _same(obs, again):
        report.add("pickle_env", "warn", "an unpickled env's reset differs from the original's",
                   "restore every attribute reset depends on when unpickling")
    else:
        report.add("pickle_env", "pass", f"pickles ({len(blob)} bytes after reset) and works after unpickling")


def _timing(report: CheckReport) -> None:
    t = report.timings
    if "reset_mean_ms" not in t:
        report.add("timing", "skip", "no reset completed")
        return
    msg = f"reset mean {t['reset_mean_ms']:.3f} ms, p95 {t['reset_p95_ms']:.3f} ms"
    if "step_mean_ms" in t:
        msg += f"; step mean {t['step_mean_ms']:.3f} ms, p95 {t['step_p95_ms']:.3f} ms"
    slow = []
    if t["reset_p95_ms"] > 1000 * SLOW_RESET_S:
        slow.append(f"reset p95 over {SLOW_RESET_S} s")
    if t.get("step_p95_ms", 0.0) > 1000 * SLOW_STEP_S:
        slow.append(f"step p95 over {SLOW_STEP_S} s")
    if slow:
        report.add("timing", "warn", msg + f" ({', '.join(slow)})",
                   "env time adds up over hundreds of envs per rollout: memoize pure generation "
                   "(functools.lru_cache keyed by the seed) and keep step cheap")
    else:
        report.add("timing", "pass", msg)
