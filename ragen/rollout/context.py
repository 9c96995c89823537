"""ContextManager: from env state to prompts, from answers to actions, and from
trajectories to training tensors.

- ``build_messages``: the chat prompt of one turn (system message with the env's
  instruction, then per turn a user message with the state, actions left and the
  last reward, and the model's earlier answers), cut to ``max_context_window``
  past turns.
- ``parse_response``: ``<think>...</think><answer>...</answer>`` (or ``<answer>``
  only when ``enable_think`` is off) -> action strings split on ``action_sep``,
  at most ``max_actions_per_turn``. Never raises.
- ``formulate_rollouts``: token ids of each whole episode with a loss mask over
  the model's own tokens only, rewards at the end of each answer
  (``use_turn_scores``) or at the last answer token, and, where the engine gave
  them, the log-prob each answer token was sampled with.
- ``GROUPINGS`` / ``METHODS``: the reward normalization's choices, which the
  config checks; the trainer normalizes (``ragen.trainer.core.normalize_rewards``).
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
# Tokens some chat models leak into answers; they are never part of an action.
_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>", "<s>")
_SPACE = re.compile(r"\s*")
GROUPINGS = ("state", "inductive", "batch")
METHODS = ("identity", "mean", "mean_std", "asym_clip")


@dataclass(frozen=True)
class ContextConfig:
    """The agent_proxy keys that shape prompts and parsing (plain, picklable)."""

    action_sep: str = "||"
    max_actions_per_turn: int = 5
    enable_think: bool = True
    max_context_window: int = -1  # past turns kept in the prompt; -1: all
    use_turn_scores: bool = False
    reward_grouping: str = "state"
    reward_method: str = "identity"

    def __post_init__(self) -> None:
        if not self.action_sep:
            raise ValueError("agent_proxy.action_sep must be a non-empty string")
        if self.max_actions_per_turn < 1:
            raise ValueError(f"agent_proxy.max_actions_per_turn must be >= 1, got {self.max_actions_per_turn}")
        if self.reward_grouping not in GROUPINGS:
            raise ValueError(
                f"agent_proxy.reward_normalization.grouping: unknown {self.reward_grouping!r}; choose one of {GROUPINGS}"
            )
        if self.reward_method not in METHODS:
            raise ValueError(
                f"agent_proxy.reward_normalization.method: unknown {self.reward_method!r}; choose one of {METHODS}"
            )


class ContextManager:
    """Holds no context, only a ``ContextConfig``: it makes prompts, parses answers and builds training tensors.

    RAGEN's name is kept. The context of an episode lives in its ``Trajectory``
    (its turns); every method here reads it from its arguments, so one instance
    serves any number of envs and threads.
    """

    def __init__(self, config: ContextConfig) -> None:
        self.config = config

    # ----- prompts -------------------------------------------------------------
    def system_message(self, spec: EnvSpec) -> dict[str, str]:
        return {"role": "system", "content": ("You're a helpful assistant. " + spec.env_instruction).strip()}

    def user_message(
        self,
        turn_index: int,
        observation: str,
        actions_left: int,
        action_names: Sequence[str] | None,
        last_reward: float | None,
        max_tokens: int | None,
    ) -> dict[str, str]:
        cfg = self.config
        parts = []
        if last_reward is not None:
            parts.append(f"Reward:\n{last_reward:g}")
        parts.append(f"Turn {turn_index + 1}:\nState:\n{observation}")
        parts.append(f"You have {actions_left} actions left.")
        if action_names:
            parts.append("Available actions: " + ", ".join(action_names))
            parts.append(
                f"You can take up to {cfg.max_actions_per_turn} actions per turn, separated by {cfg.action_sep}."
            )
        fmt = FORMAT_THINK if cfg.enable_think else FORMAT_ANSWER
        line = f"Always output: {fmt} with no extra text. Strictly follow this format."
        if max_tokens:
            line += f" Max response length: {max_tokens} words (tokens)."
        parts.append(line)
        return {"role": "user", "content": "\n".join(parts)}

    def episode_messages(self, spec: EnvSpec, turns: Sequence[Turn],
                         action_names: Sequence[str] | None) -> list[dict[str, str]]:
        """System message, the env's format example if it has one, then a user
        message and the model's answer per turn."""
        return self._head(spec) + self._turn_messages(spec, turns, 0, action_names)

    def build_messages(
        self,
        spec: EnvSpec,
        turns: Sequence[Turn],
        observation: str,
        actions_left: int,
        action_names: Sequence[str] | None,
    ) -> list[dict[str, str]]:
        """The prompt for the next turn: the episode so far, cut to
        ``max_context_window`` past turns, and the new state."""
        window = self.config.max_context_window
        start = 0 if window < 0 else max(0, len(turns) - window)
        last_reward = turns[-1].reward + turns[-1].penalty if turns else None
        return (self._head(spec) + self._turn_messages(spec, turns, start, action_names)
                + [self.user_message(len(turns), observation, actions_left, action_names, last_reward,
                                     spec.max_tokens)])

    def _head(self, spec: EnvSpec) -> list[dict[str, str]]:
        head = [self.system_message(spec)]
        if spec.format_example:
            observation, answer, names = spec.format_example
            head += [self.user_message(0, observation, spec.max_actions_per_traj, names, None, spec.max_tokens),
                     {"role": "assistant", "content": answer}]
        return head

    def _turn_messages(self, spec: EnvSpec, turns: Sequence[Turn], start: int,
                       action_names: Sequence[str] | None) -> list[dict[str, str]]:
        messages = []
        for i in range(start, len(turns)):
            t = turns[i]
            last_reward = turns[i - 1].reward + turns[i - 1].penalty if i else None
            messages.append(self.user_message(i, t.observation, t.actions_left, action_names, last_reward,
                                              spec.max_tokens))
            messages.append({"role": "assistant", "content": t.response})
        return messages

    # ----- parsing -------------------------------------------------------------
    def parse_response(self, text: str) -> list[str]:
        """Action strings of an answer; [] when it does not follow the format."""
        cfg = self.config
        content = _find_answer(text or "", cfg.enable_think)
        if content is None:
            return []
        for tok in _SPECIAL_TOKENS:
            content = content.replace(tok, "")
        actions = [a.strip() for a in content.split(cfg.action_sep) if a.strip()]
        return actions[: cfg.max_actions_per_turn]

    # ----- training ------------------------------------------------------------
    def formulate_rollouts(self, episodes: Sequence[dict[str, Any]], tokenizer: Any,
                           max_length: int | None = None) -> list[dict[str, Any]]:
        """Token ids, loss mask and per-token rewards of each episode.

        ``episodes``: dicts with ``messages`` (system, user, assistant, ...) and
        ``turn_rewards`` (one float per turn). The sequence is built piece by
        piece so that the loss mask is exact: prompt pieces (system, user, the
        template's headers) get mask 0, each answer and the template's
        end-of-turn token after it get mask 1. Assistant messages before the
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
            p = tokenizer(prompt_piece, add_special_tokens=False)["input_ids"]
            a = tokenizer(answer_piece, add_special_tokens=False)["input_ids"]
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


def _find_answer(text: str, think: bool) -> str | None:
    """The content of ``<think>...</think> <answer>...</answer>`` (or of
    ``<answer>...</answer>`` alone), as the regex
    ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` would find it, in linear
    time: the backtracking regex takes minutes on a long run of open tags."""
    if not think:
        start = text.find("<answer>")
        end = text.find("</answer>", start + 8) if start >= 0 else -1
        return text[start + 8:end] if end >= 0 else None
    if text.find("<think>") < 0:
        return None
    close = text.find("</think>", text.find("<think>") + 7)
    while close >= 0:
        rest = _SPACE.match(text, close + 8).end()
        if text.startswith("<answer>", rest):
            end = text.find("</answer>", rest + 8)
            return text[rest + 8:end] if end >= 0 else None
        close = text.find("</think>", close + 8)
    return None
