"""Configuration of a remote env: which env servers, which of their envs, and the bounds.

``env_config: {url: http://host:port, tag: SimpleSokoban}`` or
``{urls: [http://a:8101, http://b:8101], tag: ...}``. URLs are refused here,
when the config is read, unless they are ``http://`` or ``https://``, and,
for a host beyond loopback, unless the server's key is set (in the environment
variable ``key_env`` names: ``ragen.env.keys``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config_checks import EnvConfigError, check_int, check_number, check_str
from ..keys import ENV_SERVER_KEY_ENV, check_keyed_url

__all__ = ["RemoteEnvConfig"]


@dataclass
class RemoteEnvConfig:
    """Where a remote env is played, and its bounds.

    ``url`` / ``urls``: the env servers (one, or several: an env starts on the
    next one in turn and a failed one is retried from its seed on another).
    ``tag``: the env a ``python -m ragen.tools.env_server`` serves (one of its
    ``--tags``); None for a server of one env, such as an OpenEnv server.
    ``key_env``: the environment variable holding the server's key (sent with
    each session; our env servers want it, on loopback too).
    ``timeout_s``: the longest wait for one reply; ``connect_timeout_s``: for
    a connection. ``max_message_bytes``: the largest reply taken.
    ``action_field`` / ``observation_field``: where the action text goes in a
    step and where the observation text is in a reply (OpenEnv servers name
    theirs in their action and observation schemas).
    """

    SHORTHAND_KEY = "url"  # python -m ragen.tools.check remote:http://127.0.0.1:8101 --config tag=...

    url: str | None = None
    urls: list[str] | None = None
    tag: str | None = None
    key_env: str = ENV_SERVER_KEY_ENV
    timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    max_message_bytes: int = 8 * 1024 * 1024
    action_field: str = "message"
    observation_field: str = "text"
    servers: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.key_env = check_str("key_env", self.key_env)
        if (self.url is None) == (self.urls is None):
            raise EnvConfigError("url", "give the env server as url, or several as urls (a list), not both")
        if self.url is not None:
            self.servers = (check_keyed_url("url", self.url, self.key_env, "env server"),)
        else:
            if not isinstance(self.urls, (list, tuple)) or not self.urls:
                raise EnvConfigError("urls", f"expected a non-empty list of env server URLs, got {self.urls!r}")
            self.servers = tuple(check_keyed_url(f"urls[{i}]", u, self.key_env, "env server")
                                 for i, u in enumerate(self.urls))
            if len(set(self.servers)) != len(self.servers):
                raise EnvConfigError("urls", f"a server is listed twice: {list(self.servers)}")
        if self.tag is not None:
            self.tag = check_str("tag", self.tag)
            if "/" in self.tag or self.tag != self.tag.strip():
                raise EnvConfigError("tag", f"expected an env tag of the server, got {self.tag!r}")
        self.timeout_s = check_number("timeout_s", self.timeout_s, minimum=0.001)
        self.connect_timeout_s = check_number("connect_timeout_s", self.connect_timeout_s, minimum=0.001)
        self.max_message_bytes = check_int("max_message_bytes", self.max_message_bytes, minimum=1024)
        self.action_field = check_str("action_field", self.action_field)
        self.observation_field = check_str("observation_field", self.observation_field)

