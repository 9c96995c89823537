"""The OpenAI engine's token-prompt path: prompts sent as token ids to ``/completions``.

With ``engine.tokenizer`` (the folder or cached id of the model the server
runs, or ``default``; ``load_tokenizer``), each prompt is the engine's
``prompt_ids(request)``: the request's history ids (the ids sampled so far)
and the template's tokens of its new messages, ending with its answer prefix.
``complete_ids`` sends it as ``"prompt": ids`` (vLLM takes a list of token ids
as a prompt) with the sampling fields, seed and ``"return_token_ids": true``;
log-probs are asked as ``"logprobs": 0`` (the sampled tokens only). The
completion is ``choices[0].text``, its ``token_ids`` and
``logprobs.token_logprobs``; its prompt ids are those the server reports it
sampled after, else the ids sent (a server that reports other ids than those
sent is named in one warning). A server that refuses token prompts (an HTTP
4xx) or answers without the sampled ids raises ``NoTokenPrompts``: the engine
sends the request as messages, unless its prompt ids were given
(``prompt_token_ids``), which go as ids or not at all. ``vocab_size`` is the larger of ``len(tokenizer)`` and
the ``vocab_size`` of the ``config.json`` beside it: models pad their
embedding past the tokenizer, and a server may sample a padded id.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ragen.errors import RagenError
from ragen.llm.default_model import resolve_model_path
from ragen.llm.openai_http import HTTPTransport, RefusedError, session_key
from ragen.llm.openai_replies import ReplyReader, finish_reason
from ragen.llm.types import Completion, GenerationRequest


class NoTokenPrompts(RagenError, RuntimeError):
    """The server cannot take a token prompt or return the sampled ids: the request goes as messages."""


def complete_ids(http: HTTPTransport, replies: ReplyReader, request: GenerationRequest, ids: list[int],
                 fields: dict[str, Any], logprobs: bool, version: int) -> Completion:
    """``request``'s prompt ``ids`` sent to ``/completions`` with the sampling ``fields``;
    ``NoTokenPrompts`` when the server refuses them (an HTTP 4xx) or answers without the
    sampled ids."""
    body = {**fields, "prompt": ids, "return_token_ids": True}
    if logprobs:
        body["logprobs"] = 0  # the sampled tokens' own, no alternatives
    route = "/completions"
    try:
        reply = http.post(route, body, session_key(request))
    except RefusedError as exc:
        raise NoTokenPrompts(str(exc)) from exc
    choice = replies.choice(reply, route)
    text = replies.text(choice.get("text"), route, "choices[0].text")
    if not isinstance(choice.get("token_ids"), list):
        raise NoTokenPrompts(f"its reply from {http.base_url}{route} carries no token ids "
                             f"(choices[0].token_ids, asked with return_token_ids)")
    response_ids = replies.ids(choice["token_ids"], route, "choices[0].token_ids")
    prompt = replies.prompt_ids(request, ids, choice.get("prompt_token_ids") or reply.get("prompt_token_ids"), route)
    values = None
    if logprobs:
        raw = choice.get("logprobs")
        values = replies.checked_logprobs(raw.get("token_logprobs") if isinstance(raw, dict) else None,
                                          response_ids, raw)
    return Completion.answering(request, text, prompt, response_ids, finish_reason(choice), version, values)


def load_tokenizer(tokenizer: Any) -> Any:
    """``engine.tokenizer``: a transformers tokenizer as it is, or one loaded from a local
    folder, a cached model id or ``default`` (never downloaded); it must have a chat template."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        path = resolve_model_path(tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"engine.tokenizer={getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template: "
                         f"token prompts are built with it; use the server's model folder, or null to send messages")
    return tokenizer


def vocab_size(tokenizer: Any) -> int:
    """The ids the server's model may return: ``len(tokenizer)``, or the ``vocab_size`` of the
    model's config.json beside the tokenizer when larger (an embedding padded past the tokenizer)."""
    size = len(tokenizer)
    path = os.path.join(str(getattr(tokenizer, "name_or_path", "") or ""), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):  # no model config beside the tokenizer: its length is all we know
        return size
    sections = [config, config.get("text_config")] if isinstance(config, dict) else []
    for section in sections:
        value = section.get("vocab_size") if isinstance(section, dict) else None
        if type(value) is int:
            size = max(size, value)
    return size
