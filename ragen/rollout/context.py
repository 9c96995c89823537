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
  ``max_actions_per_turn``; ``normalize_response`` is the answer as later
  prompts show it (RAGEN's tidied ``<think>..</think><answer>..</answer>``).
  Never raises.
- ``formulate_rollouts``: token ids of each whole episode with a loss mask over
  the model's own tokens only, rewards at the end of each answer
  (``use_turn_scores``) or at the last answer token, and, where the engine gave
  them, the log-prob each answer token was sampled with.
- ``GROUPINGS`` / ``METHODS`` / ``WINDOW_MODES``: the config's choices;
  the trainer normalizes rewards (``ragen.trainer.core.normalize_rewards``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ragen.rollout.types import EnvSpec, Turn
from ragen.utils import common_prefix_length

FORMAT_THINK = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
FORMAT_ANSWER = "<answer> [your answer] </answer>"
SYSTEM_START = "You're a helpful assistant. "
INVALID_WARNING = "No valid action provided previously. Environment state remains the same. Please try again.\n"
# Removed from the think and answer text, in this order, each followed by a strip (RAGEN's list),
# then tokens some servers leak into answers; none is ever part of an action.
_SPECIAL_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>",
                   "<|endoftext|>", "</s>", "<s>")
_SPACE = re.compile(r"\s*")
GROUPINGS = ("state", "inductive", "batch")
METHODS = ("identity", "mean", "mean_std", "asym_clip")
WINDOW_MODES = ("full", "limited_multi_turn", "single_turn")
TOKEN_HISTORIES = ("append", "rerender")


@dataclass(frozen=True)
class ContextConfig:
    """The agent_proxy keys that shape prompts and parsing (plain, picklable)."""

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

    def __post_init__(self) -> None:
        if not self.action_sep:
            raise ValueError("agent_proxy.action_sep must be a non-empty string")
        if self.max_actions_per_turn < 1:
            raise ValueError(f"agent_proxy.max_actions_per_turn must be >= 1, got {self.max_actions_per_turn}")
        if self.context_window_mode not in WINDOW_MODES:
            raise ValueError(f"agent_proxy.context_window_mode: unknown {self.context_window_mode!r}; "
                             f"choose one of {WINDOW_MODES}")
        if self.token_history not in TOKEN_HISTORIES:
            raise ValueError(f"ctx_manager.token_history: unknown {self.token_history!r}; choose one of "
                             f"{TOKEN_HISTORIES}")
        if self.token_history == "append" and self.context_window_mode != "full":
            raise ValueError(
                f"ctx_manager.token_history=append keeps every earlier turn's tokens in the prompt, and "
                f"agent_proxy.context_window_mode={self.context_window_mode} cuts them: set "
                f"ctx_manager.token_history=rerender with it, or context_window_mode=full")
        if self.reward_grouping not in GROUPINGS:
            raise ValueError(
                f"agent_proxy.reward_normalization.grouping: unknown {self.reward_grouping!r}; choose one of {GROUPINGS}"
            )
        if self.reward_method not in METHODS:
            raise ValueError(
                f"agent_proxy.reward_normalization.method: unknown {self.reward_method!r}; choose one of {METHODS}"
            )


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
        return self._head(spec) + self._conversation(spec, self._entries(turns, as_written=True), 0)

    def sampled(self, turns: Sequence[Turn]) -> list[tuple[tuple[int, ...], tuple[float, ...] | None]]:
        """Each turn's sampled ids and their log-probs, for ``formulate_rollouts``;
        the log-probs None where the turn's prompt is not its context in
        ``episode_messages`` (a log-prob holds only under the context it was
        sampled in): after an earlier answer that the prompts showed tidied
        otherwise than written, and where the layout cut or summarized the
        history."""
        cfg = self.config
        out, same = [], True
        for k, t in enumerate(turns):
            cut = cfg.context_window_mode == "single_turn" or (
                cfg.context_window_mode == "limited_multi_turn" and 0 < cfg.max_context_window <= k)
            out.append((t.response_ids, t.logprobs if same and not cut else None))
            same = same and self.normalize_response(t.response) == self.answer_prefix + t.response
        return out

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
        fmt = FORMAT_THINK if self.config.enable_think else FORMAT_ANSWER
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
    def formulate_rollouts(self, episodes: Sequence[dict[str, Any]], tokenizer: Any,
                           max_length: int | None = None) -> list[dict[str, Any]]:
        """Token ids, loss mask and per-token rewards of each episode.

        ``episodes``: dicts with ``messages`` (system, user, assistant, ...) and
        ``turn_rewards`` (one float per turn). The sequence is built piece by
        piece so that the loss mask is exact: prompt pieces (system, user, the
        template's headers, the answer prefix) get mask 0, each answer and the
        template's end-of-turn token after it get mask 1. Assistant messages before the
        last ``len(turn_rewards)`` ones are format examples: mask 0.

        ``sampled`` (optional; one per turn): the engine's ``(token ids,
        log-probs)`` of each answer (log-probs None where the engine gave none).
        ``behaviour_logprobs`` then holds, per token, the log-prob it was sampled
        with: for the answer tokens up to where the engine's tokens and these
        first differ (a token's log-prob holds only after the same prefix), NaN
        elsewhere; None without ``sampled``.
        """
        out = []
        for ep in episodes:
            ids, mask, rewards, behaviour = self._tokenize_episode(ep["messages"], ep["turn_rewards"], tokenizer,
                                                                   ep.get("sampled"))
            if max_length is not None and len(ids) > max_length:
                ids, mask, rewards = ids[:max_length], mask[:max_length], rewards[:max_length]
                behaviour = None if behaviour is None else behaviour[:max_length]
            out.append({"input_ids": ids, "loss_mask": mask, "token_rewards": rewards,
                        "behaviour_logprobs": behaviour})
        return out

    def _tokenize_episode(self, messages, turn_rewards, tokenizer, sampled=None):
        ids: list[int] = []
        mask: list[int] = []
        rewards: list[float] = []
        behaviour: list[float] | None = None if sampled is None else []
        answers = iter(sampled or ())
        rendered = ""
        answer_ends: list[int] = []
        n_examples = sum(m["role"] == "assistant" for m in messages) - len(turn_rewards)
        for k, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            example = n_examples > 0
            n_examples -= 1
            before = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=False)
            after = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
            prompt_piece = before[len(rendered):]
            answer_piece = after[len(before):].rstrip("\n")  # the template's trailing newline is not the model's
            # the answer prefix was part of the prompt the engine tokenized: not the model's either
            written = answer_piece
            if not example and answer_piece.startswith(self.answer_prefix):
                written = answer_piece[len(self.answer_prefix):]
            p = tokenizer(prompt_piece + answer_piece[:len(answer_piece) - len(written)],
                          add_special_tokens=False)["input_ids"]
            a = tokenizer(written, add_special_tokens=False)["input_ids"]
            ids += p + a
            mask += [0] * len(p) + [0 if example else 1] * len(a)
            rewards += [0.0] * (len(p) + len(a))
            if behaviour is not None:
                known: list[float] = []
                if not example:
                    engine_ids, logprobs = next(answers, ((), None))
                    if logprobs is not None:
                        known = list(logprobs[:common_prefix_length([a, list(engine_ids)])])
                behaviour += [math.nan] * len(p) + known + [math.nan] * (len(a) - len(known))
            if not example:
                answer_ends.append(len(ids) - 1)
            rendered = before + answer_piece
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
