"""ContextManager: from env state to prompts, from answers to actions, and from
trajectories to training tensors.

- ``build_messages``: the chat prompt of one turn, RAGEN's character for
  character: a system message ("You're a helpful assistant. ", the env's
  instruction, the meaning of its grid symbols, its actions), then per turn the
  state, the actions left and the answer format, the model's answer, and
  ``Reward:`` with the turn's reward. ``context_window_mode`` picks RAGEN's
  layout: ``full`` (the whole episode), ``limited_multi_turn`` (the last
  ``max_context_window`` turns, the current one included) or ``single_turn``
  (one user message that summarizes those turns). ``answer_prefix`` is what
  the answer starts with after the template's generation prompt (``<think>``,
  or ``<answer>`` without thinking): the engines place it, the model writes
  what follows.
- ``parse_response``: the model's text after the answer prefix ->
  ``<think>...</think><answer>...</answer>`` (or ``<answer>`` only when
  ``enable_think`` is off) -> action strings split on ``action_sep``, at most
  ``max_actions_per_turn``; ``parse_calls``: a tool env's answer -> its tool
  calls (``tool_parser``), whose results the next prompt shows as ``tool``
  messages; ``normalize_response`` is the answer as later
  prompts show it (RAGEN's tidied ``<think>..</think><answer>..</answer>``).
  Never raises.
- ``formulate_rollouts``: the training rows of each episode, the token ids as the
  engine saw and sampled them, with a loss mask over the sampled tokens only,
  rewards at the end of each answer (``use_turn_scores``) or at the last answer
  token, and the log-prob each answer token was sampled with: an env's episode
  is one row, an agent's one per segment or per call (``agent_samples``).
- ``GROUPINGS`` / ``METHODS`` / ``WINDOW_MODES``: the config's choices;
  the trainer normalizes rewards (``ragen.trainer.core.normalize_rewards``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ragen.config_reader import check_setting
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.tool_calls import CALL_FORMAT, FORMAT_TOOLS, PARSERS, BadCall, ToolCall, parse_hermes, read_server_calls
from ragen.llm.types import Completion
from ragen.rollout.agent_samples import agent_rows
from ragen.rollout.types import EnvSpec, Turn, turn_prompts

FORMAT_THINK = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
FORMAT_ANSWER = "<answer> [your answer] </answer>"
SYSTEM_START = "You're a helpful assistant. "
INVALID_WARNING = "No valid action provided previously. Environment state remains the same. Please try again.\n"
NO_TOOL_CALL = ("No valid tool call provided previously. Environment state remains the same. Please try again, "
                f"calling a tool as\n{CALL_FORMAT}\n")
# Removed from the think and answer text, in this order, each followed by a strip (RAGEN's list),
# then tokens some servers leak into answers; none is ever part of an action.
_SPECIAL_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>",
                   "<|endoftext|>", "</s>", "<s>")
_SPACE = re.compile(r"\s*")
GROUPINGS = ("state", "inductive", "batch")
METHODS = ("identity", "mean", "mean_std", "asym_clip")
WINDOW_MODES = ("full", "limited_multi_turn", "single_turn")
TOKEN_HISTORIES = ("append", "rerender")
SAMPLE_SHAPES = ("segment", "call")  # agent.sample_shape


@dataclass(frozen=True)
class ContextConfig:
    """The agent_proxy and ctx_manager keys that shape prompts and parsing (plain, picklable); it checks
    their values, naming the key."""

    action_sep: str = "||"
    max_actions_per_turn: int = 5
    enable_think: bool = True
    context_window_mode: str = "full"
    # turns shown by limited_multi_turn and single_turn, the current one included; -1 or 0: all
    max_context_window: int = -1
    use_turn_scores: bool = False
    reward_grouping: str = "state"
    reward_method: str = "identity"
    response_length: int = 128  # the "Max response length" a prompt states for an env without max_tokens
    # append: a prompt is the episode's ids so far (the answers as sampled) and the new
    # message's tokens; rerender: every prompt rendered whole, answers tidied (RAGEN's text)
    token_history: str = "append"
    # train the end-of-turn token the template adds after an answer cut at its token limit
    # (loss mask 1, as if sampled; it has no behaviour log-prob); false: mask 0
    train_end_after_cut: bool = False
    # how a tool env's calls are read: "hermes" (<tool_call>{json}</tool_call> in the answer's text),
    # "server" (the tool_calls an OpenAI-compatible server parsed)
    tool_parser: str = "hermes"
    # agent.sample_shape: an agent episode's training samples, one per segment or one per call
    agent_sample_shape: str = "segment"

    def __post_init__(self) -> None:
        # the one check of these keys, wherever a ContextConfig is built (a config, a dump, code)
        if not self.action_sep:
            raise ValueError("agent_proxy.action_sep must be a non-empty string")
        check_setting("agent_proxy.max_actions_per_turn", self.max_actions_per_turn, minimum=1)
        check_setting("agent_proxy.context_window_mode", self.context_window_mode, choices=WINDOW_MODES)
        check_setting("agent_proxy.max_context_window", self.max_context_window, minimum=-1)
        check_setting("ctx_manager.token_history", self.token_history, choices=TOKEN_HISTORIES)
        check_setting("ctx_manager.tool_parser", self.tool_parser, choices=PARSERS)
        check_setting("agent.sample_shape", self.agent_sample_shape, choices=SAMPLE_SHAPES)
        if self.token_history == "append" and self.context_window_mode != "full":
            raise ValueError(
                f"ctx_manager.token_history=append keeps every earlier turn's tokens in the prompt, and "
                f"agent_proxy.context_window_mode={self.context_window_mode} cuts them: set "
                f"ctx_manager.token_history=rerender with it, or context_window_mode=full")
        check_setting("agent_proxy.reward_normalization.grouping", self.reward_grouping, choices=GROUPINGS)
        check_setting("agent_proxy.reward_normalization.method", self.reward_method, choices=METHODS)


@dataclass(frozen=True)
class _Entry:
    """One turn as a prompt shows it: the state, then (past turns only) the answer and its reward."""

    state: str
    actions_left: int
    warning: bool  # the turn before had no valid action
    answer: str | None = None
    reward: Any = None


class ContextManager:
    """Holds no context, only a ``ContextConfig``: it makes prompts, parses answers and builds training tensors.

    RAGEN's name is kept. The context of an episode lives in its ``Trajectory``
    (its turns); every method here reads it from its arguments, so one instance
    serves any number of envs and threads.
    """

    def __init__(self, config: ContextConfig) -> None:
        self.config = config

    @property
    def answer_prefix(self) -> str:
        """What every answer starts with, placed after the generation prompt."""
        return "<think>" if self.config.enable_think else "<answer>"

    # ----- prompts -------------------------------------------------------------
    def system_message(self, spec: EnvSpec) -> dict[str, str]:
        content = SYSTEM_START + spec.env_instruction + spec.state_legend
        if spec.action_names is not None:
            content += ("\nYour available actions are:\n" + ", ".join(spec.action_names)
                        + f"\nYou can make up to {spec.max_actions_per_traj} actions, separated by the action "
                        f"separator \" {self.config.action_sep} \"\n")
        return {"role": "system", "content": content}

    def build_messages(self, spec: EnvSpec, turns: Sequence[Turn], observation: str,
                       actions_left: int) -> list[dict[str, str]]:
        """The prompt for the next turn: the episode so far in the window
        ``context_window_mode`` keeps, and the new state. Earlier answers are
        tidied (``normalize_response``) under ``token_history: rerender``, as
        RAGEN shows them; under ``append`` they are as written (their tokens
        lead the prompt)."""
        if spec.tools:
            return self._tool_conversation(spec, turns, current=(observation, actions_left))[0]
        entries = self._entries(turns, current=(observation, actions_left),
                                as_written=self.config.token_history == "append")
        cfg = self.config
        offset = 0
        if cfg.context_window_mode != "full" and 0 < cfg.max_context_window < len(entries):
            offset = len(entries) - cfg.max_context_window
            entries = entries[offset:]
        if cfg.context_window_mode == "single_turn":
            return self._head(spec) + [{"role": "user", "content": self._summary(spec, entries, offset)}]
        return self._head(spec) + self._conversation(spec, entries, offset)

    def episode_messages(self, spec: EnvSpec, turns: Sequence[Turn]) -> list[dict[str, str]]:
        """The whole episode as one conversation (``full`` layout), up to its
        last answer: what the trainer tokenizes. Each answer is as the model
        wrote it (the answer prefix, then its text), so the trained tokens are
        the sampled ones; a later prompt showed it tidied
        (``normalize_response``), which differs where the model put spaces
        around its tags or more actions than a turn takes."""
        return self._layout(spec, turns)[0]

    def _layout(self, spec: EnvSpec, turns: Sequence[Turn]) -> tuple[list[dict[str, str]], list[int]]:
        """``episode_messages`` and where each turn's answer is in them."""
        if spec.tools:
            return self._tool_conversation(spec, turns)
        head = self._head(spec)
        messages = head + self._conversation(spec, self._entries(turns, as_written=True), 0)
        return messages, [len(head) + 2 * k + 1 for k in range(len(turns))]

    def _tool_conversation(self, spec: EnvSpec, turns: Sequence[Turn], current: tuple[str, int] | None = None
                           ) -> tuple[list[dict[str, str]], list[int]]:
        """A tool env's episode (``full`` layout only): the first state, then each answer as
        written and a ``tool`` message with the result of each of its calls (a user message
        saying so when it made none); up to the last answer, or with what answers it when
        ``current`` is given. And where each answer is."""
        first = (turns[0].observation, turns[0].actions_left) if turns else current
        messages = self._head(spec) + [{"role": "user", "content": self._state(spec, _Entry(*first, False), 1)}]
        answers = []
        for k, turn in enumerate(turns):
            answers.append(len(messages))
            messages.append({"role": "assistant", "content": self.answer_prefix + turn.response})
            if k + 1 < len(turns) or current is not None:
                messages += [{"role": "tool", "content": result, "tool_call_id": f"call_{k + 1}_{i + 1}"}
                             for i, result in enumerate(turn.tool_results)] or \
                            [{"role": "user", "content": NO_TOOL_CALL}]
        return messages, answers

    def _entries(self, turns: Sequence[Turn], current: tuple[str, int] | None = None,
                 as_written: bool = False) -> list[_Entry]:
        """The turns as prompts show them, then the ``current`` state (observation, actions left) if given;
        a state after a turn that executed no action carries RAGEN's warning."""
        def warned(i: int) -> bool:
            return i > 0 and not turns[i - 1].executed_actions

        entries = [_Entry(t.observation, t.actions_left, warned(i),
                          self.answer_prefix + t.response if as_written else self.normalize_response(t.response),
                          t.reward)
                   for i, t in enumerate(turns)]
        if current is not None:
            entries.append(_Entry(*current, warned(len(turns))))
        return entries

    def _head(self, spec: EnvSpec) -> list[dict[str, str]]:
        head = [self.system_message(spec)]
        if spec.format_example:
            observation, answer = spec.format_example
            example = _Entry(observation, spec.max_actions_per_traj, False)
            head += [{"role": "user", "content": self._state(spec, example, 1)},
                     {"role": "assistant", "content": answer}]
        return head

    def _state(self, spec: EnvSpec, entry: _Entry, number: int) -> str:
        return f"\nTurn {number}:\n" + self._state_body(spec, entry)

    def _state_body(self, spec: EnvSpec, entry: _Entry) -> str:
        """The state, the warning after a turn without a valid action, the actions left and the format."""
        fmt = FORMAT_TOOLS if spec.tools else FORMAT_THINK if self.config.enable_think else FORMAT_ANSWER
        max_tokens = spec.max_tokens if spec.max_tokens is not None else self.config.response_length
        warning = INVALID_WARNING if entry.warning else ""
        return (f"State:\n{entry.state}\n{warning}You have {entry.actions_left} actions left. "
                f"Always output: {fmt} with no extra text. Strictly follow this format. "
                f"Max response length: {max_tokens} words (tokens).\n")

    def _conversation(self, spec: EnvSpec, entries: Sequence[_Entry], offset: int) -> list[dict[str, str]]:
        """A user message per turn (the reward of the turn before, then the
        state), and the model's answers between them."""
        messages = [{"role": "user", "content": ""}]
        for i, entry in enumerate(entries):
            messages[-1]["content"] += self._state(spec, entry, i + 1 + offset)
            if entry.answer is not None:
                messages.append({"role": "assistant", "content": entry.answer})
                if i + 1 < len(entries):
                    messages.append({"role": "user", "content": f"Reward:\n{entry.reward}\n"})
        return messages

    def _summary(self, spec: EnvSpec, entries: Sequence[_Entry], offset: int) -> str:
        """``single_turn``: the earlier turns as text, then the current state."""
        *past, current = entries
        content = ""
        if past:
            content += (f"Summary: {len(past) + offset} step(s) completed so far. Showing the last {len(past)} "
                        "turn(s) with state/action/reward details. Recent turns:\n---\n")
            for i, entry in enumerate(past):
                number = i + 1 + offset
                content += (f"Turn {number} State:\n{entry.state}\nTurn {number} Action: {entry.answer}\n"
                            f"Turn {number} Reward: {entry.reward}\n---\n")
        separator = "\n" if content else ""
        content += f"{separator}{'Current Turn ' if past else ''}(Turn {len(past) + 1 + offset}):\n"
        return content + self._state_body(spec, current)

    # ----- parsing -------------------------------------------------------------
    def parse_response(self, text: str) -> list[str]:
        """Action strings of an answer (the model's text after ``answer_prefix``);
        [] when it does not follow the format."""
        return self._parse(text)[1]

    def parse_calls(self, completion: Completion, tools: Sequence[Any]) -> list[ToolCall | BadCall]:
        """A tool env's answer as its calls, in order, read as ``tool_parser`` says."""
        if self.config.tool_parser == "server":
            if completion.tool_calls is None:
                return [BadCall("", "the engine's reply carries no tool calls parsed by a server "
                                    "(ctx_manager.tool_parser=server reads those of the OpenAI engine's chat "
                                    "path; set ctx_manager.tool_parser=hermes to read the answer's text)")]
            return read_server_calls(completion.tool_calls, tools)
        return parse_hermes(self.answer_prefix + completion.text, tools)

    def normalize_response(self, text: str) -> str:
        """The answer as later prompts show it: ``<think>{thoughts}</think><answer>{actions}</answer>``
        with the special tokens and outer spaces gone and the actions cut to
        ``max_actions_per_turn``; the answer as written (with its prefix) when
        it does not follow the format."""
        return self._parse(text)[0]

    def _parse(self, text: str) -> tuple[str, list[str]]:
        cfg = self.config
        response = self.answer_prefix + (text or "")
        found = _find_answer(response, cfg.enable_think)
        if found is None:
            return response, []
        think, content = found
        for tok in _SPECIAL_TOKENS:
            content = content.replace(tok, "").strip()
            think = think.replace(tok, "").strip()
        actions = [a.strip() for a in content.split(cfg.action_sep) if a.strip()]
        if len(actions) > cfg.max_actions_per_turn:
            actions = actions[: cfg.max_actions_per_turn]
            content = f" {cfg.action_sep} ".join(actions)
        if cfg.enable_think:
            return f"<think>{think}</think><answer>{content}</answer>", actions
        return f"<answer>{content}</answer>", actions

    # ----- training ------------------------------------------------------------
    def formulate_rollouts(self, episodes: Sequence[tuple[EnvSpec, Sequence[Turn]]], chat: ChatTokens,
                           max_length: int | None = None) -> list[list[dict[str, Any]]]:
        """The training rows of each ``(spec, turns)`` episode: per episode, a list of rows, each its
        token ids, loss mask, per-token rewards, behaviour log-probs, and the indices of the turns it
        trains (``turns``). Each row is cut at ``max_length`` on its own.

        An env's episode is one row. The sequence is the first prompt, then each answer's sampled ids (mask
        1), each followed by what the next prompt adds (mask 0). A turn whose
        prompt, as the engine saw it, starts with the sequence so far (always
        under ``token_history: append``) adds exactly those ids, and its answer
        tokens carry the log-prob each was sampled with. Otherwise (a prompt
        rendered whole that rewrote an earlier answer, or no prompt ids from the
        engine) the sequence appends the template's tokens of the new message
        (``ChatTokens.append``) and the answer's log-probs are NaN: they were
        sampled under another context. An answer without ids is encoded from its
        text. The end-of-turn token the template adds after an answer that did
        not end with one (cut at its length) has mask 0, or 1 with
        ``train_end_after_cut``. Rewards sit on each answer's last token
        (``use_turn_scores``) or all on the last answer's.

        An agent episode (``env_type: agent``) is a row per segment of its calls, or per call
        (``agent_sample_shape``; ``ragen.rollout.agent_samples``): only the ids its calls sent and
        sampled, never a template's render.
        """
        out = []
        for spec, turns in episodes:
            if spec.is_agent:
                rows = agent_rows(turns, self.config.agent_sample_shape)
            else:
                ids, mask, rewards, behaviour = self._episode_tokens(spec, turns, chat)
                rows = [{"input_ids": ids, "loss_mask": mask, "token_rewards": rewards,
                         "behaviour_logprobs": behaviour, "turns": list(range(len(turns)))}]
            if max_length is not None:
                for row in rows:
                    for key in ("input_ids", "loss_mask", "token_rewards", "behaviour_logprobs"):
                        row[key] = row[key][:max_length]
            out.append(rows)
        return out

    def _episode_tokens(self, spec: EnvSpec, turns: Sequence[Turn], chat: ChatTokens):
        messages: list[dict[str, str]] = []  # the episode's messages (when needed), its answers at answers[k]
        answers: list[int] = []
        ids: list[int] = []
        mask: list[int] = []
        behaviour: list[float] = []
        answer_ends: list[int] = []
        open_end = False  # the last answer did not end its turn
        for k, (turn, prompt) in enumerate(zip(turns, turn_prompts(turns))):  # prompts as the engine saw them
            exact = prompt is not None and prompt[:len(ids)] == ids
            if not exact:
                if not messages:
                    messages, answers = self._layout(spec, turns)
                shown = messages[:answers[k]]
                prompt = chat.full(shown, self.answer_prefix, spec.tools) if k == 0 else \
                    chat.append(ids, shown, answers[k - 1] + 1, self.answer_prefix, spec.tools)[0]
            added = len(prompt) - len(ids)
            ids = prompt
            mask += [0] * added
            if open_end and self.config.train_end_after_cut and added and ids[len(ids) - added] in chat.end_texts:
                mask[len(ids) - added] = 1
            answer = list(turn.response_ids) if turn.response_ids or not turn.response else chat.encode(turn.response)
            logprobs = turn.logprobs if exact and turn.logprobs is not None and len(turn.logprobs) == len(answer) \
                else None
            behaviour += [math.nan] * added + (list(logprobs) if logprobs is not None else [math.nan] * len(answer))
            ids = ids + answer
            mask += [1] * len(answer)
            answer_ends.append(len(ids) - 1)
            open_end = not answer or answer[-1] not in chat.end_texts
        if open_end and self.config.train_end_after_cut and turns:
            end = chat.encode(chat.closing())[:1]
            if end and end[0] in chat.end_texts:
                ids, mask, behaviour = ids + end, mask + [1], behaviour + [math.nan]
        rewards = [0.0] * len(ids)
        turn_rewards = [t.reward + t.penalty for t in turns]
        if answer_ends:
            if self.config.use_turn_scores:
                for end, r in zip(answer_ends, turn_rewards):
                    rewards[end] += float(r)
            else:
                rewards[answer_ends[-1]] += float(sum(turn_rewards))
        return ids, mask, rewards, behaviour


def _find_answer(text: str, think: bool) -> tuple[str, str] | None:
    """The thoughts and the answer of ``<think>...</think> <answer>...</answer>``
    (thoughts "" for ``<answer>...</answer>`` alone), as the regex
    ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` would find them, in linear
    time: the backtracking regex takes minutes on a long run of open tags."""
    if not think:
        start = text.find("<answer>")
        end = text.find("</answer>", start + 8) if start >= 0 else -1
        return ("", text[start + 8:end]) if end >= 0 else None
    open_ = text.find("<think>")
    if open_ < 0:
        return None
    close = text.find("</think>", open_ + 7)
    while close >= 0:
        rest = _SPACE.match(text, close + 8).end()
        if text.startswith("<answer>", rest):
            end = text.find("</answer>", rest + 8)
            return (text[open_ + 7:close], text[rest + 8:end]) if end >= 0 else None
        close = text.find("</think>", close + 8)
    return None
