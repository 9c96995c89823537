"""Replay: play a dumped episode again, in this process, and check it.

``python -m ragen.tools.replay DUMP.jsonl [--env-id N ...] [--engine NAME [--checkpoint DIR]] [--model MODEL]
[--config FILE] [--allow-env-type MODULE:CLASS]``

For each env asked for (every env of the dump when none is), the env is built
again from its spec and reset with its seed, and the turn loop (the same
``run_envs`` as in a rollout) feeds it the answers recorded in the dump, turn
by turn. Everything runs in the calling thread, one env after another, with no
time limits and no retries, so ``pdb`` (or a breakpoint in the env's code)
works. Every prompt, observation, reward and done flag is checked against the
dump, and so are the prompt's token ids where both the dump and the replay's
engine have them (the recorded answers come with none: ``--engine`` gives
them); the first difference is printed, or "identical". A replay plays at most
one turn past the dump's last (that turn is already a difference), whatever
``max_turn`` the dump says. ``--engine`` has a model answer instead of the
recorded answers (with the dump's sampling parameters and seeds: for greedy
decoding, or a scripted policy, it must reproduce the dump too). Those
answers come from the policy version that sampled them (every turn records
it): a model's replay that differs where the engine is at another version
says so, and ``--checkpoint DIR`` (with ``--engine hf``) answers with a
training checkpoint's policy: its weights, or its LoRA adapter on ``--model``.

An agent tag's episode (``env_type: agent``) builds no env and runs no program:
its recorded tokens are checked against the model's chat template (``--engine``'s,
or, without one, ``--model``'s tokenizer). Each chat call's prompt is rendered
again from the messages its turn keeps, by the gateway's own ``SessionTokens``
(a segment's first call whole, a call that extends appended to the ids before
it), and compared with the recorded prompt ids and cause: each call that differs
is printed, naming the episode and the call (a template drift), or "tokens
match the template".

- ``RecordedEngine``: an ``Engine`` that answers each request with the dump's
  answer for its ``(env_id, turn)``.
- ``replay(record, engine=None, env_types=None) -> Replay``: one env played
  again and compared; ``env_types`` (``AllowedEnvTypes``, default: the
  registered names only) says which env types it may build.
- ``first_difference(record, trajectory, prompts)``: where a replayed
  trajectory first differs from its record, as a sentence; ``None`` if nowhere
  (of an agent program's output, only its info is compared, as
  ``rollout_digest`` does: its stdout, stderr and traceback are records for
  people).
- ``replay_agent(record, chat) -> Replay``: an agent episode's calls checked
  against a chat template; ``Replay.drifts`` names each call that differs.
- ``version_note(record, engine)``: that the dump's answers came from another
  policy version than the engine's, and how to load that version.

A dump is data: it names its env types, but only the types of the user's own
setup are built (``ragen.env.allowed``): registered names, the import paths
named by the ``custom_envs`` of ``--config FILE`` (an envs YAML, a run
folder's ``config.yaml`` or a Hydra config such as ``config/base.yaml``), and
``--allow-env-type package.module:Class``. Any other type is refused before
its module is imported. The env configs the file holds then go through their
config class's checks, as a config's ``custom_envs`` do (``check_env_configs``).

Exit status: 0 when every env replays identically (an agent episode: its tokens
match), 1 when one differs, 2 for bad input (a missing, truncated or foreign
file, an env id not in the dump, an env type the setup does not name, an env
config that its class refuses, such as a size past its bound, agent episodes
and neither ``--engine`` nor ``--model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from ragen.env import make_env_config
from ragen.env.allowed import AllowedEnvTypes, EnvTypeNotAllowed, add_allow_options, allowed_env_types
from ragen.gateway.api_error import ApiError
from ragen.gateway.calls import read_chat
from ragen.gateway.segments import Prompt, SessionTokens
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.types import ABORTED, Completion, Engine, GenerationRequest, SamplingParams
from ragen.rollout.agent_call import COMPLETIONS, AgentCall, call_messages
from ragen.rollout.dump import DumpError, DumpRecord, read_dump
from ragen.serving import DirectClient
from ragen.rollout.scheduler import EnvError, KeptEnvs, run_envs
from ragen.rollout.types import StopReason, Trajectory, turn_prompts
from ragen.utils import closed_on_failure, common_prefix_length

logger = logging.getLogger(__name__)


class RecordedEngine(Engine):
    """Answers with the recorded answers of one dump record (and, after its
    last turn, the answer its env failed on, if it failed within a turn, the
    engine's error, if the env ended in error without one, or ``ABORTED``, if
    over-sampling cut it short there); a turn the
    dump does not have is answered with an empty text (the comparison
    reports it)."""

    name = "recorded"

    def __init__(self, record: DumpRecord) -> None:
        super().__init__()
        self.record = record

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        trajectory = self.record.trajectory
        turns = trajectory.turns
        out = []
        for r in requests:
            turn = turns[r.turn] if r.turn < len(turns) else None
            tool_calls = list(turn.tool_calls) if turn is not None and turn.tool_calls is not None else None
            if turn is not None:
                text, finish, version = turn.response, turn.finish_reason, turn.policy_version
            elif r.turn == len(turns) and trajectory.failed_response is not None:
                text, finish, version = trajectory.failed_response, "stop", -1  # the answer the env failed on
            elif r.turn == len(turns) and trajectory.stop_reason == StopReason.ERROR:
                text, finish, version = "", "error", -1  # the engine failed on this turn's request
            elif r.turn == len(turns) and trajectory.stop_reason == StopReason.ABORTED:
                text, finish, version = "", ABORTED, -1  # cut short there: its rollout had enough groups
            else:
                text, finish, version = "", "stop", -1
            out.append(Completion(text=text, prompt_token_ids=[], response_token_ids=[], finish_reason=finish,
                                  policy_version=version, env_id=r.env_id, turn=r.turn, tool_calls=tool_calls))
        return out


class _PromptsSeen(Engine):
    """Passes requests to ``engine`` and keeps the prompt of the first turn whose prompt is
    not the dump's (``expected``, per turn): the only one that can be the first difference.
    Every turn's prompt kept would grow with the square of the turns."""

    def __init__(self, engine: Engine, expected: Sequence[Sequence[dict[str, str]]]) -> None:
        super().__init__()
        self.engine = engine
        self.name = engine.name
        self.expected = expected
        self.prompts: dict[int, list[dict[str, str]]] = {}

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        for r in requests:
            if r.turn < len(self.expected) and r.messages != self.expected[r.turn] \
                    and (not self.prompts or r.turn < min(self.prompts)):
                self.prompts = {r.turn: r.messages}
        return self.engine.generate(requests, sampling)


@dataclass
class Replay:
    """One dumped env played again: its record, the replayed trajectory, and where they first differ
    (an agent episode's: its calls' prompts rendered again, and each call whose ids differ)."""

    record: DumpRecord
    trajectory: Trajectory  # as played again (an agent episode's: as dumped, its program is not run)
    difference: str | None  # None: identical
    # why a model's answers may differ: the dump's were sampled by another policy version (version_note)
    note: str | None = None
    calls: int = 0  # an agent episode's chat calls checked against the template
    drifts: list[str] = field(default_factory=list)  # each call whose prompt the template does not give

    @property
    def identical(self) -> bool:
        return self.difference is None


def is_agent(record: DumpRecord) -> bool:
    """Whether ``record`` is an agent tag's episode: calls of a program, no env to build."""
    return record.spec.is_agent


def replay_agent(record: DumpRecord, chat: ChatTokens) -> Replay:
    """An agent episode's recorded tokens checked against ``chat``, the model's chat template and
    tokenizer: each chat call's prompt built again from the messages its turn keeps
    (``ragen.rollout.agent_call``) by the gateway's own ``SessionTokens`` (a segment's first call
    rendered whole, a call that extends appended to the ids before it and the ids sampled) and
    compared with the recorded ids and cause. A difference is a template drift; the next call goes
    on from the recorded ids, so each call is checked on its own. The program is not run. A
    completions call's prompt is text that is not kept: it is carried, not checked."""
    turns = record.trajectory.turns
    calls = [AgentCall.of_turn(t, f"turn {i}") for i, t in enumerate(turns)]
    tokens = SessionTokens(chat)
    checked, drifts = 0, []
    for call, turn, recorded, (messages, tools) in zip(calls, turns, turn_prompts(turns), call_messages(calls)):
        recorded = recorded or []
        if call.endpoint == COMPLETIONS:
            tokens.answered_text(tokens.text_prompt(recorded), turn.response_ids)
            continue
        checked += 1
        where = f"call {call.index} (segment {call.segment}, {call.cause or 'extends it'})"
        try:
            asked = read_chat({"messages": messages, "tools": tools}, max(1, len(messages)))
            answer = read_chat({"messages": [call.answer]}, 1).said[0]  # as a call that repeats it says it
            prompt = tokens.prompt(asked)
        except ApiError as exc:
            drifts.append(f"{where}: its messages are not a chat call's: {exc.message}")
            continue
        except Exception as exc:  # noqa: BLE001 - a template may raise on any message it refuses
            drifts.append(f"{where}: the template cannot render its messages: {type(exc).__name__}: {exc}")
            continue
        if prompt.ids != recorded:
            drifts.append(f"{where}: prompt ids: {_ids_diff(recorded, prompt.ids, 'template')}")
        elif prompt.cause != call.cause:
            drifts.append(f"{where}: the template makes it {prompt.cause or 'extend its segment'}")
        # on from the recorded ids: the next call is checked on its own
        tokens.answered(asked, Prompt(recorded, prompt.segment, call.cause, turn.prompt_start, prompt.held),
                        turn.response_ids, answer)
    return Replay(record, record.trajectory, drifts[0] if drifts else None, calls=checked, drifts=drifts)


def replay(record: DumpRecord, engine: Engine | None = None, raise_errors: bool = False,
           env_types: AllowedEnvTypes | None = None) -> Replay:
    """Play ``record``'s env again from its spec and seed, in the calling
    thread, with the recorded answers (or ``engine``'s), and compare.
    ``raise_errors``: an exception in the env propagates (for a debugger)
    instead of ending the replay in ``error`` as the rollout did.
    ``env_types``: the env types it may build (default: registered names
    only); any other raises ``EnvTypeNotAllowed`` before anything is imported. An agent
    episode's tokens are checked against ``engine``'s chat template (``replay_agent``)."""
    if is_agent(record):
        chat = getattr(engine, "chat", None)
        if not isinstance(chat, ChatTokens):
            raise ValueError(f"env {record.env_id} is an agent episode: its tokens are checked against the model's "
                             "chat template, which this engine has none of")
        return replay_agent(record, chat)
    check_env_types([record], env_types)
    check_env_configs([record])
    spec = dataclasses.replace(record.spec, env_threads=1)  # the calling thread steps it
    # one turn past the dump's last already differs: the dump's max_turn (data) never keeps a replay going
    max_turn = min(record.loop.max_turn, len(record.trajectory.turns) + 1)
    loop = dataclasses.replace(record.loop, env_timeout_s=None, env_retries=0, max_turn=max_turn)
    seen = _PromptsSeen(engine if engine is not None else RecordedEngine(record), record.messages)
    kept = KeptEnvs()
    try:
        (trajectory,), _ = run_envs([spec], DirectClient(seen), loop, kept_envs=kept,
                                    isolate_errors=not raise_errors)
    except EnvError as exc:
        raise exc.__cause__ or exc
    finally:
        kept.close()
    difference = first_difference(record, trajectory, seen.prompts)
    note = version_note(record, engine) if difference is not None and engine is not None else None
    return Replay(record, trajectory, difference, note)


def version_note(record: DumpRecord, engine: Engine) -> str | None:
    """Where ``record``'s answers were sampled by policy versions other than ``engine``'s: a sentence
    saying so, and how to replay with a checkpoint's weights; None where they were not."""
    versions = sorted({t.policy_version for t in record.trajectory.turns if t.policy_version >= 0})
    if not versions or versions == [engine.policy_version]:
        return None
    which = " and ".join(str(v) for v in versions)
    base = ", the base model" if engine.policy_version == 0 else ""
    return (f"the dump's answers were sampled by policy version {which}; the engine answers as version "
            f"{engine.policy_version}{base}: replay with --checkpoint <run folder>/checkpoints/global_step_<N>, "
            f"the checkpoint whose meta.json says policy_version {versions[-1]}, to answer with its weights")


def check_env_types(records: Sequence[DumpRecord], env_types: AllowedEnvTypes | None = None) -> None:
    """Raise ``EnvTypeNotAllowed`` (naming the record's line) for the first
    record whose env or config type ``env_types`` does not allow."""
    env_types = env_types if env_types is not None else AllowedEnvTypes()
    for r in records:
        if is_agent(r):  # no env to build: its program is never run
            continue
        try:
            env_types.check(r.spec.env_type, r.spec.config_type, r.spec.tag)
        except EnvTypeNotAllowed as exc:
            raise EnvTypeNotAllowed(f"line {r.line}: {exc}") from None


def check_env_configs(records: Sequence[DumpRecord]) -> None:
    """Raise ``DumpError`` (naming the record's line and the key) for the first record
    whose env config its config class refuses, as a config's ``custom_envs`` would
    be (a size past its bound, an unknown key) at start-up: a dump is input, and an env
    built from a refused config could take the machine's memory. Check the env types
    first (``check_env_types``): this imports the config's class."""
    for r in records:
        if is_agent(r):
            continue
        try:
            make_env_config(r.spec.env_type, r.spec.env_config, r.spec.config_type, r.spec.tag)
        except ValueError as exc:
            raise DumpError(f"line {r.line}: {exc}") from None


def first_difference(record: DumpRecord, replayed: Trajectory,
                     prompts: dict[int, list[dict[str, str]]] | None = None) -> str | None:
    """The first place where ``replayed`` differs from the dump, as a sentence."""
    dumped = record.trajectory
    # one turn's prompt ids at a time, from each side
    dumped_ids, replayed_ids = turn_prompts(dumped.turns), turn_prompts(replayed.turns)
    for i in range(max(len(dumped.turns), len(replayed.turns))):
        if i >= len(replayed.turns):
            return (f"turn {i}: the dump has this turn, the replay ended before it "
                    f"(replay stop reason {replayed.stop_reason.value}{_error(replayed)})")
        if i >= len(dumped.turns):
            return (f"turn {i}: the replay went on past the dump's last turn "
                    f"(dump stop reason {dumped.stop_reason.value})")
        a, b = dumped.turns[i], replayed.turns[i]
        if a.observation != b.observation:
            return f"turn {i}: state shown: {_diff(a.observation, b.observation)}"
        if prompts is not None and i in prompts and record.messages[i] != prompts[i]:
            return f"turn {i}: prompt: {_prompt_diff(record.messages[i], prompts[i])}"
        x, y = next(dumped_ids), next(replayed_ids)
        if x is not None and y is not None and x != y:
            return f"turn {i}: prompt ids: {_ids_diff(x, y)}"
        for name in ("response", "actions", "executed_actions", "tool_results"):
            if getattr(a, name) != getattr(b, name):
                return f"turn {i}: {name}: {_diff(getattr(a, name), getattr(b, name))}"
        for j in range(max(len(a.steps), len(b.steps))):
            if j >= len(a.steps) or j >= len(b.steps):
                return f"turn {i}: the dump has {len(a.steps)} env steps, the replay {len(b.steps)}"
            for name in ("action", "observation", "reward", "done"):
                x, y = getattr(a.steps[j], name), getattr(b.steps[j], name)
                if x != y:
                    return f"turn {i}, step {j} ({a.steps[j].action}): {name}: {_diff(x, y)}"
        for name in ("reward", "penalty", "info", "finish_reason"):
            if getattr(a, name) != getattr(b, name):
                return f"turn {i}: {name}: {_diff(getattr(a, name), getattr(b, name))}"
    for name in ("stop_reason", "success", "error", "failed_response", "final_observation"):
        x, y = getattr(dumped, name), getattr(replayed, name)
        if x != y:
            return f"end of episode: {name}: {_diff(x, y)}"
    # an agent program's info is part of its result; its captured output is a record for people
    x, y = (dumped.program or {}).get("info"), (replayed.program or {}).get("info")
    if x != y:
        return f"end of episode: program info: {_diff(x, y)}"
    return None


def _ids_diff(dumped: list[int], replayed: list[int], other: str = "replay") -> str:
    k = common_prefix_length([dumped, replayed])
    return (f"the dump has {len(dumped)} ids, the {other} {len(replayed)}; from id {k}: "
            f"dump {_short(dumped[k:k + 8])}, {other} {_short(replayed[k:k + 8])}")


def _error(t: Trajectory) -> str:
    return f": {t.error}" if t.error else ""


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _diff(dumped: Any, replayed: Any) -> str:
    return f"dump {_short(dumped)}, replay {_short(replayed)}"


def _prompt_diff(dumped: list[dict[str, str]], replayed: list[dict[str, str]]) -> str:
    for m, (x, y) in enumerate(zip(dumped, replayed)):
        if x != y:
            return f"message {m} ({x.get('role')}): {_diff(x.get('content'), y.get('content'))}"
    return f"the dump has {len(dumped)} messages, the replay {len(replayed)}"


# ----------------------------------------------------------------------------- command line


def _id_list(ids: Sequence[int]) -> str:
    """``0-7, 12, 14-15``: the ids as ranges."""
    ids = sorted(set(ids))
    parts, start = [], None
    for k, x in enumerate(ids):
        if start is None:
            start = x
        if k + 1 == len(ids) or ids[k + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def _engine_from_args(args: argparse.Namespace) -> Engine | None:
    if args.engine is None:
        return None
    import yaml

    from ragen.llm import make_engine

    options: dict[str, Any] = {"name": args.engine}
    for item in args.engine_opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-opt {item!r}: write it as key=value")
        options[key] = yaml.safe_load(value)
    if args.checkpoint is not None and args.engine != "hf":
        raise ValueError(f"--checkpoint loads a checkpoint's weights into the hf engine (--engine hf), not into "
                         f"--engine {args.engine}")
    model = args.model
    if model is None and args.engine in ("hf", "vllm"):
        model = "default"
    if model is not None:
        from ragen.llm.default_model import resolve_model_path

        model = resolve_model_path(model)
    engine = make_engine(options, model)
    if args.checkpoint is not None:
        from ragen.trainer.policy import load_checkpoint_policy

        with closed_on_failure(engine.close):  # a checkpoint it cannot load: the engine built for it is closed
            if not hasattr(engine, "model"):
                raise ValueError("--checkpoint loads a checkpoint's weights into one hf engine: leave out "
                                 "--engine-opt replicas")
            engine.policy_version = load_checkpoint_policy(engine.model, args.checkpoint)
        engine.release_cache()
    return engine


def _report(result: Replay) -> str:
    """What the command prints of one replay: "identical" (an agent episode's: "tokens match"), or
    where it differs (an agent episode's: each call, a line each)."""
    t = result.record.trajectory
    if is_agent(result.record):
        where = f"env {t.env_id} ({t.tag}, seed {t.seed}, {len(t.turns)} calls)"
        if result.identical:
            return f"{where}: tokens match the template ({result.calls} chat calls)"
        return "\n".join(f"{where}: differs at {d} (a template drift)" for d in result.drifts)
    where = f"env {t.env_id} ({t.tag}, seed {t.seed}, {len(t.turns)} turns)"
    if result.identical:
        return f"{where}: identical"
    return f"{where}: differs at {result.difference}" + (f" ({result.note})" if result.note else "")


def _agent_chat(records: Sequence[DumpRecord], engine: Engine | None, model: str | None) -> ChatTokens | None:
    """The chat template and tokenizer the agent episodes among ``records`` are checked against:
    the engine's, else ``model``'s tokenizer (as the openai engine builds it); None without agent
    episodes. ValueError when there is none to check them with."""
    agents = [r.env_id for r in records if is_agent(r)]
    if not agents:
        return None
    if engine is not None:
        chat = getattr(engine, "chat", None)
        if not isinstance(chat, ChatTokens):
            raise ValueError(f"--engine {engine.name} has no chat template and tokenizer here, which the agent "
                             f"episodes' (env {_id_list(agents)}) tokens are checked against: give --model")
        return chat
    if model is None:
        raise ValueError(f"env {_id_list(agents)}: agent episodes, whose tokens are checked against the model's chat "
                         "template: give --model (its tokenizer) or --engine")
    from ragen.llm.openai_tokens import load_tokenizer

    return ChatTokens.of(load_tokenizer(model))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen.tools.replay", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", help="a rollout dump (.jsonl or .jsonl.gz)")
    parser.add_argument("--env-id", type=int, action="append", default=[],
                        help="an env of the dump to replay (repeatable); default: every env")
    parser.add_argument("--engine", help="re-generate the answers with this engine (hf, vllm, openai, scripted) "
                                         "instead of feeding the recorded ones")
    parser.add_argument("--model", help="the engine's model (hf, vllm; default: the embedded default model); "
                                        "without --engine, the tokenizer agent episodes are checked with")
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine option, as in config/engine/<name>.yaml (repeatable)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="with --engine hf: answer with the policy of a training checkpoint, "
                             "<run folder>/checkpoints/global_step_<N> (its weights, or its LoRA adapter on --model, "
                             "the run's base model); pick the one whose meta.json has the dump's policy_version")
    add_allow_options(parser, "build")
    parser.add_argument("--raise", dest="raise_errors", action="store_true",
                        help="let an exception in the env propagate (with its traceback, for a debugger) "
                             "instead of comparing it with the dump")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        records = read_dump(args.dump)
        by_id = {r.env_id: r for r in records}
        missing = [i for i in args.env_id if i not in by_id]
        if missing:
            raise DumpError(f"{args.dump}: env id(s) {missing} not in the dump; its env ids: "
                            f"{_id_list(list(by_id))}")
        chosen = [by_id[i] for i in args.env_id] if args.env_id else records
        env_types = allowed_env_types(args.config, args.allow_env_type)
        try:
            check_env_types(chosen, env_types)  # before any env's module is imported
            check_env_configs(chosen)
        except (EnvTypeNotAllowed, DumpError) as exc:
            raise type(exc)(f"{args.dump} {exc}") from None
        engine = _engine_from_args(args)
        with closed_on_failure(engine.close if engine is not None else None):
            chat = _agent_chat(chosen, engine, args.model)
    except (DumpError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    differ = 0
    try:
        for record in chosen:
            result = replay_agent(record, chat) if is_agent(record) else \
                replay(record, engine, raise_errors=args.raise_errors, env_types=env_types)
            print(_report(result))
            differ += not result.identical
    finally:
        if engine is not None:
            engine.close()
    if len(chosen) > 1:
        print(f"{len(chosen) - differ} of {len(chosen)} envs identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
