"""``LLM``: what an agent's ``run`` gets as ``llm``, its episode's own session of the gateway."""

from __future__ import annotations

import threading
from typing import Any


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ImportError("llm.client and llm.async_client need the openai client: pip install openai "
                          "(the dev extra has it: pip install -e '.[dev]')") from None
    return openai


class LLM:
    """An episode's session: ``base_url`` (``http://HOST:PORT/sessions/<id>/v1``), ``api_key`` (the
    session's own), ``model`` (the served name; any name is answered by the session's engine), and
    ``openai`` clients on them, ``client`` (sync) and ``async_client``, each made when first used.
    Its ``repr`` leaves the key out."""

    def __init__(self, base_url: str, api_key: str, model: str) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.model = model
        self._lock = threading.Lock()
        self._client: Any = None
        self._async_client: Any = None

    def __repr__(self) -> str:
        return f"LLM(base_url={self.base_url!r}, model={self.model!r})"

    @property
    def client(self) -> Any:
        """An ``openai.OpenAI`` on the session."""
        with self._lock:
            if self._client is None:
                self._client = _openai().OpenAI(base_url=self.base_url, api_key=self.api_key)
            return self._client

    @property
    def async_client(self) -> Any:
        """An ``openai.AsyncOpenAI`` on the session (use it on one event loop: an async entry's own)."""
        with self._lock:
            if self._async_client is None:
                self._async_client = _openai().AsyncOpenAI(base_url=self.base_url, api_key=self.api_key)
            return self._async_client

    def environment(self) -> dict[str, str]:
        """The variables that point a command's ``openai`` client (and the frameworks on it) at the session."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_BASE": self.base_url, "OPENAI_API_KEY": self.api_key}

    async def aclose(self) -> None:
        """The async client closed, on the event loop it was used on (an async entry's, as it ends)."""
        with self._lock:
            client, self._async_client = self._async_client, None
        if client is not None:
            await client.close()

    def close(self) -> None:
        """The sync client closed (its connections); the async one is closed by ``aclose`` on its loop."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
