"""Configuration of the code env: attempts, the reward, and the sandbox's limits."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import ToolFormConfig, function_tool
from ..config_checks import EnvConfigError, check_int, check_number, check_str
from ..sandbox import BACKENDS, Limits, SandboxUnavailable, backend

__all__ = ["CodeEnvConfig"]


@dataclass
class CodeEnvConfig(ToolFormConfig):
    """``attempts``: submissions an episode may make (a failed one shows the first failing test);
    ``reward``: ``fraction`` (of the tests passed) or ``all`` (1 only when every test passes);
    ``cpu_s``, ``wall_s``, ``memory_mb``, ``output_bytes``: the sandbox's limits for one submission;
    ``dataset_path``: a DeepCoder file (Parquet or JSON lines, ``deepcoder.py``) whose problems the seeds
    pick instead of the shipped ones; ``tool_calls``: a submission is a call of the tool ``run_tests(code)``
    instead of the code in the answer's text; ``sandbox``: which sandbox runs submissions (``auto``: bwrap,
    else util-linux's namespaces as root; refused when none isolates; ``none``: unisolated, said by name)."""

    attempts: int = 1
    reward: str = "fraction"
    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    dataset_path: str | None = None
    sandbox: str = "auto"
    # the tool form of a submission (``tool_calls: true``)
    TOOLS = [function_tool("run_tests", "Run a Python program against the problem's tests; returns the verdict.",
                           code="The whole Python program.")]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.attempts = check_int("attempts", self.attempts, minimum=1, maximum=100)
        self.reward = check_str("reward", self.reward, choices=("fraction", "all"))
        self.cpu_s = check_number("cpu_s", self.cpu_s, minimum=0.1, maximum=600)
        self.wall_s = check_number("wall_s", self.wall_s, minimum=0.1, maximum=3600)
        self.memory_mb = check_int("memory_mb", self.memory_mb, minimum=64, maximum=65536)
        self.output_bytes = check_int("output_bytes", self.output_bytes, minimum=1024, maximum=64 * 1024 * 1024)
        self.sandbox = check_str("sandbox", self.sandbox, choices=BACKENDS)
        try:
            backend(self.sandbox)  # probed once a process: refused here, at start-up, when none isolates
        except SandboxUnavailable as exc:
            raise EnvConfigError("sandbox", str(exc)) from None
        if self.dataset_path is not None:
            from .deepcoder import load_problems

            load_problems(check_str("dataset_path", self.dataset_path))  # read (and checked) once a process

    def limits(self) -> Limits:
        return Limits(cpu_s=self.cpu_s, wall_s=self.wall_s, memory_mb=self.memory_mb, output_bytes=self.output_bytes,
                      sandbox=self.sandbox)
