"""Configuration of the search env: the retrieval server, how results are shown, and the reward."""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any

from ..base import ToolFormConfig, function_tool
from ..config_checks import check_int, check_number, check_str
from ..keys import RETRIEVAL_KEY_ENV, check_keyed_url
from .server import MAX_QUERY_CHARS

__all__ = ["SearchEnvConfig"]


logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def warn_if_unreachable(url: str) -> None:
    """A warning, once a process, when the server does not answer now (the envs end in error if it never does)."""
    from .client import health

    why = health(url)
    if why is not None:
        logger.warning("the retrieval server %s does not answer /health (%s): search envs will end in error until "
                       "it does; start it with python -m ragen.tools.retrieval_server", url, why)


@dataclass
class SearchEnvConfig(ToolFormConfig):
    """``server_url``: the retrieval server (``python -m ragen.tools.retrieval_server``, or any server of
    RAGEN's ``/retrieve`` API); ``key_env``: the environment variable holding its key (ours wants it, on
    loopback too); ``top_k`` documents a search shows, each cut to ``max_doc_chars``;
    ``max_steps``: actions an episode may take (searches and the answer); ``reward``: ``f1`` (the answer's
    token F1 with the truth when at least ``f1_threshold``, 1 on an exact match) or ``em`` (1 on an exact
    match); ``timeout_s``: the longest wait for one search; ``max_query_chars``: the longest query a search
    sends (the shipped server refuses longer ones; a longer one is an invalid action, its observation
    naming the limit, and in the tool form a call off the schema, with the format penalty);
    ``tool_calls``: the actions are calls of the tools ``search(query)`` and ``finish(answer)`` instead of
    RAGEN's text form."""

    server_url: str = "http://127.0.0.1:8000"
    key_env: str = RETRIEVAL_KEY_ENV
    top_k: int = 3
    max_doc_chars: int = 800
    max_steps: int = 5
    reward: str = "f1"
    f1_threshold: float = 0.3
    timeout_s: float = 30.0
    max_query_chars: int = MAX_QUERY_CHARS
    # the tool form of the actions (``tool_calls: true``)
    TOOLS = [function_tool("search", "Search the corpus; returns the top documents.", query="What to search for."),
             function_tool("finish", "Give the final answer to the question; ends the episode.",
                           answer="The answer, a few words.")]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.key_env = check_str("key_env", self.key_env)
        self.server_url = check_keyed_url("server_url", self.server_url, self.key_env, "retrieval server")
        self.top_k = check_int("top_k", self.top_k, minimum=1, maximum=50)
        self.max_doc_chars = check_int("max_doc_chars", self.max_doc_chars, minimum=20, maximum=100_000)
        self.max_steps = check_int("max_steps", self.max_steps, minimum=1, maximum=100)
        self.reward = check_str("reward", self.reward, choices=("f1", "em"))
        self.f1_threshold = check_number("f1_threshold", self.f1_threshold, minimum=0.0, maximum=1.0)
        self.timeout_s = check_number("timeout_s", self.timeout_s, minimum=0.001)
        self.max_query_chars = check_int("max_query_chars", self.max_query_chars, minimum=1, maximum=1_000_000)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """``TOOLS``, the query bounded by ``max_query_chars`` (a longer one is a call off the schema)."""
        if not self.tool_calls:
            return None
        tools = copy.deepcopy(self.TOOLS)
        search = next(t["function"] for t in tools if t["function"]["name"] == "search")
        search["parameters"]["properties"]["query"]["maxLength"] = self.max_query_chars
        return tools
