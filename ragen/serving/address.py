"""Where a server listens: ``check_listen_address`` reads ``llm_server.host`` and
``llm_server.port`` (the manager's) or ``gateway.host`` and ``gateway.port`` before
any model loads; a manager listening beyond loopback warns that its port must be
firewalled, and a gateway there needs a key (``is_loopback``)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from ragen.errors import ConfigError


# the config section of each server's address -> who listens, and who connects
_LISTENERS = {"llm_server": ("the manager", "workers"), "gateway": ("the gateway", "clients")}


def check_listen_address(host: Any, port: Any, section: str = "llm_server") -> tuple[str, int]:
    """``(host, port)`` for the manager (``section`` llm_server) or the gateway (gateway) to
    listen on; ConfigError (a ValueError) naming ``<section>.host`` or ``<section>.port``
    otherwise. Read before any model loads, and again by the server."""
    who, peers = _LISTENERS[section]
    if not isinstance(host, str) or not host.strip() or host != host.strip():
        hint = " (an empty host listens on every interface without saying so)" if host == "" else ""
        raise ConfigError(f"{section}.host must be the address to listen on: 127.0.0.1 for {peers} on this "
                          f"machine, 0.0.0.0 for {peers} on other machines; got {host!r}{hint}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{section}.port must be an integer from 0 to 65535 (0: any free port), got {port!r}")
    _check_bindable(host, section, who, peers)
    return host, port


def _check_bindable(host: str, section: str, who: str, peers: str) -> None:
    """ConfigError naming ``<section>.host`` unless the server can listen on
    it: an IPv4 address (or a name for one) of this machine. Tried on a free
    port, so that a wrong host is found before a model loads, not when the
    server binds after it."""
    try:
        infos = socket.getaddrinfo(host, 0, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        ipv6 = ":" in host
        why = (f"{who} listens on IPv4 only: use 127.0.0.1 for {peers} on this machine, 0.0.0.0 for "
               f"{peers} on other machines" if ipv6 else f"it does not resolve to an IPv4 address ({exc.strerror})")
        raise ConfigError(f"{section}.host={host!r} cannot be listened on: {why}") from None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((infos[0][4][0], 0))
    except OSError as exc:
        raise ConfigError(f"{section}.host={host!r} cannot be listened on: {exc.strerror or exc} (an address of "
                          "this machine, 127.0.0.1 or 0.0.0.0)") from None



def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (an IPv6 zone, ``%eth0``, ignored)."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False
