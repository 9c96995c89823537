"""Rollout workers beyond one machine: Dask and Ray behind joblib.

- ``ClusterConfig``: where the cluster is (``dask.scheduler_address``,
  ``ray.address``), how large a local one to start when none is given
  (``dask.n_workers``), and the host workers use to reach the shared LLM
  manager (``llm_server.advertise_host``).
- ``Cluster``: what a ``ParallelRolloutManager`` opens once for a ``dask`` or
  ``ray`` backend and closes at ``close()``: a ``distributed.Client`` (on the
  given scheduler, or on a ``LocalCluster`` started for the run) or a Ray
  connection (``ray.init``). ``joblib_backend()`` is what the executor's
  ``joblib.Parallel`` runs on: joblib's own Dask backend bound to that client,
  or Ray's joblib backend (``register_ray``); no scheduler of ours.
- ``Cluster.worker_client``: the ``SharedLLMClient`` with an address remote
  workers can connect to. The client (and in it the manager's key) travels
  only inside the pickled task payload; its repr hides the key.

Losing a worker: Dask re-runs a task whose worker died on another worker (up
to ``distributed.scheduler.allowed-failures`` times; 1 on the local cluster
started here), which gives the same trajectories; after that the task fails
with ``KilledWorker``, and the rollout manager runs the shard again as it does
for a dead local process. Ray raises ``ActorDiedError`` at once, with the same
outcome.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
from dataclasses import dataclass, replace
from typing import Any, Iterator

from ragen.serving import SharedLLMClient
from ragen.utils import is_loopback_host

logger = logging.getLogger(__name__)

_WILDCARD = {"", "0.0.0.0", "::"}
# An env that kills its process kills every worker it lands on: one retry on
# another worker covers a lost machine; then the rollout manager takes over.
LOCAL_DASK_ALLOWED_FAILURES = 1


@dataclass(frozen=True)
class ClusterConfig:
    """Where the dask and ray backends find their cluster, and how its workers reach the driver."""

    dask_scheduler_address: str | None = None  # e.g. tcp://10.0.0.1:8786; None: a LocalCluster for the run
    dask_n_workers: int | None = None  # LocalCluster size; None: parallel_n_jobs, or one per core
    ray_address: str | None = None  # e.g. 10.0.0.1:6379, "auto"; None: RAY_ADDRESS, or a new local Ray
    advertise_host: str | None = None  # how workers reach the manager; None: found for you

    def __post_init__(self) -> None:
        if self.dask_n_workers is not None and (
                isinstance(self.dask_n_workers, bool) or not isinstance(self.dask_n_workers, int)
                or self.dask_n_workers < 1):
            raise ValueError(f"dask.n_workers must be an integer >= 1 or null, got {self.dask_n_workers!r}")


class Cluster:
    """A Dask or Ray connection held for a rollout manager's lifetime."""

    backend = ""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config

    def joblib_backend(self) -> Any:
        """A joblib backend (name or instance) for one ``joblib.Parallel``."""
        raise NotImplementedError

    def worker_host(self) -> str:
        """An address of this machine that the cluster's workers can reach."""
        raise NotImplementedError

    def is_remote(self) -> bool:
        """Whether workers may run on other machines."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def worker_client(self, client: SharedLLMClient) -> SharedLLMClient:
        """``client`` with an address the workers can connect to.

        ``advertise_host`` wins when set. A manager listening on a wildcard
        address (0.0.0.0) is reached at this machine's address on the route to
        the cluster. A manager on loopback cannot be reached from other
        machines: that is logged, not refused (the workers may be local).
        """
        host, port = client.address[0], client.address[1]
        if self.config.advertise_host:
            return replace(client, address=(self.config.advertise_host, port))
        if host in _WILDCARD:
            reachable = self.worker_host()
            logger.info("shared LLM manager listens on %s:%d; %s workers reach it at %s:%d "
                        "(set llm_server.advertise_host to change this)", host, port, self.backend, reachable, port)
            return replace(client, address=(reachable, port))
        if is_loopback_host(host) and self.is_remote():
            logger.warning("llm_server.host is %s: %s workers on other machines cannot reach the shared LLM "
                           "manager; set llm_server.host=0.0.0.0 (and llm_server.advertise_host if this machine's "
                           "address as seen by the workers is not %s)", host, self.backend, self.worker_host())
        return client


# the package each cluster backend imports, and how to install it (setup.py's extras)
BACKEND_PACKAGES = {
    "dask": ("dask.distributed", "pip install 'dask[distributed]' (or pip install -e '.[dask]')"),
    "ray": ("ray", "pip install 'ray[default]' (or pip install -e '.[ray]')"),
}


def check_installed(backend: str) -> None:
    """ValueError naming the package and how to install it where ``backend`` (a cluster's) needs one
    that does not import: the config check's, before any model loads."""
    if backend not in BACKEND_PACKAGES:
        return
    package, install = BACKEND_PACKAGES[backend]
    try:
        importlib.import_module(package)
    except ImportError:
        raise ValueError(f"agent_proxy.parallel_backend={backend} needs {package}, which is not installed: "
                         f"{install}") from None


@contextlib.contextmanager
def _needs(backend: str) -> Iterator[None]:
    """Imports within: an ImportError says that ``agent_proxy.parallel_backend=<backend>`` needs its
    package, and how to install it."""
    package, install = BACKEND_PACKAGES[backend]
    try:
        yield
    except ImportError as exc:
        raise ImportError(f"agent_proxy.parallel_backend={backend} needs {package}: {install}") from exc


def open_cluster(backend: str, config: ClusterConfig | None = None, n_jobs: int = -1) -> Cluster | None:
    """Start or attach to the cluster of ``backend``; None for one-machine backends."""
    config = config or ClusterConfig()
    if backend == "dask":
        return DaskCluster(config, n_jobs)
    if backend == "ray":
        return RayCluster(config, n_jobs)
    return None


# ----- Dask ------------------------------------------------------------------------

class DaskCluster(Cluster):
    """A dask.distributed client (to a running scheduler, or a LocalCluster started for the run) and
    joblib's Dask backend on it."""

    backend = "dask"

    def __init__(self, config: ClusterConfig, n_jobs: int = -1) -> None:
        super().__init__(config)
        with _needs(self.backend):
            import dask
            from distributed import Client, LocalCluster
        self.address = config.dask_scheduler_address
        self._local = None
        if self.address:
            logger.info("connecting to the Dask scheduler at %s", self.address)
            try:
                self.client = Client(self.address, set_as_default=False, timeout=30)
            except OSError as exc:
                raise ConnectionError(f"dask.scheduler_address: no Dask scheduler reachable at {self.address!r} "
                                      f"({exc}); start one with `dask scheduler` and workers with "
                                      f"`dask worker {self.address}`") from exc
        else:
            n = config.dask_n_workers or (n_jobs if n_jobs >= 1 else (os.cpu_count() or 1))
            with dask.config.set({"distributed.scheduler.allowed-failures": LOCAL_DASK_ALLOWED_FAILURES}):
                self._local = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                           dashboard_address=None, host="127.0.0.1")
            self.client = Client(self._local, set_as_default=False)
            self.address = self._local.scheduler_address
            logger.info("started a local Dask cluster (%d worker processes) at %s", n, self.address)

    def joblib_backend(self) -> Any:
        # a fresh backend per executor, on this client (not a process-wide default one)
        return _dask_backend_class()(client=self.client)

    def worker_host(self) -> str:
        host = _host_of(self.address)
        return "127.0.0.1" if is_loopback_host(host) else _route_ip(host)

    def is_remote(self) -> bool:
        return self._local is None and not is_loopback_host(_host_of(self.address))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        if self._local is not None:
            with contextlib.suppress(Exception):
                self._local.close()
            self._local = None


_DASK_BACKEND: type | None = None


def _dask_backend_class() -> type:
    """joblib's Dask backend with two fixes for rollouts (joblib 1.6):

    - a task that Dask gives up on (``KilledWorker``: its worker died
      ``allowed-failures + 1`` times) reaches ``Parallel`` as an error; joblib
      calls a task's callback only on success and would wait forever;
    - a cluster with one worker (or one restarting after a crash) still runs
      the shards on the cluster: joblib runs a call in the calling process
      when the backend reports one worker, where an env that kills its
      process would take the driver down.
    """
    global _DASK_BACKEND
    if _DASK_BACKEND is None:
        from joblib._dask import DaskDistributedBackend

        class RolloutDaskBackend(DaskDistributedBackend):
            def submit(self, func, callback=None):
                future = super().submit(func, callback)
                if callback is not None:
                    def report_failure(f):
                        if not f.cancelled() and f.exception() is not None:
                            callback(f.exception())  # joblib raises an exception it is given as a result
                    future.add_done_callback(report_failure)
                return future

            def effective_n_jobs(self, n_jobs):
                return max(2, super().effective_n_jobs(n_jobs))

        _DASK_BACKEND = RolloutDaskBackend
    return _DASK_BACKEND


# ----- Ray -------------------------------------------------------------------------

class RayCluster(Cluster):
    """A connection to a Ray cluster (or a local Ray started for the run) and Ray's joblib backend
    on it."""

    backend = "ray"

    def __init__(self, config: ClusterConfig, n_jobs: int = -1) -> None:
        super().__init__(config)
        with _needs(self.backend):
            import ray
            from joblib.pool import PicklingPool
            from ray.util.joblib import register_ray
        self._ray = ray
        self.address = config.ray_address
        self._started = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False}
            if self.address:
                kwargs["address"] = self.address
            elif not os.environ.get("RAY_ADDRESS"):
                # a new instance for the run, not one `ray start` left on this machine; its
                # workers import what the driver can (env classes named "module:Class")
                kwargs["address"] = "local"
                kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
                if n_jobs >= 1:
                    kwargs["num_cpus"] = n_jobs
            logger.info("connecting to Ray at %s", kwargs.get("address") or os.environ["RAY_ADDRESS"])
            try:
                ray.init(**kwargs)
            except ConnectionError as exc:
                raise ConnectionError(
                    f"ray.address: cannot connect to a Ray cluster at {kwargs.get('address')!r} ({exc}); start one "
                    f"with `ray start --head`; a cluster with token authentication needs RAY_AUTH_MODE=token "
                    f"and its token (RAY_AUTH_TOKEN or ~/.ray/auth_token) in the driver") from exc
            self._started = True
        else:
            logger.info("using the Ray connection this process already has")
        register_ray()
        # ray's joblib backend re-parents joblib's PicklingPool onto Ray's Pool
        # (for the whole process); put it back at close()
        self._pool_bases = PicklingPool.__bases__

    def joblib_backend(self) -> Any:
        return "ray"

    def worker_host(self) -> str:
        return self._ray.util.get_node_ip_address()

    def is_remote(self) -> bool:
        here = self.worker_host()
        return any(n.get("NodeManagerAddress") != here for n in self._ray.nodes() if n.get("Alive"))

    def close(self) -> None:
        from joblib.pool import PicklingPool

        PicklingPool.__bases__ = self._pool_bases
        if self._started:
            self._started = False
            with contextlib.suppress(Exception):
                self._ray.shutdown()


# ----- addresses -------------------------------------------------------------------

def _host_of(address: str) -> str:
    """The host of ``tcp://host:port``, ``host:port`` or ``[v6]:port``."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        return rest[1:rest.index("]")]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def _route_ip(target: str) -> str:
    """This machine's address on the route to ``target`` (no packet is sent)."""
    with contextlib.suppress(OSError):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())
