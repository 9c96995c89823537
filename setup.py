from setuptools import find_packages, setup

setup(
    name="ragen",
    version="0.1.0",
    description="Process-parallel rollout engine for multi-turn RL of language-model agents (RAGEN-compatible)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # hydra_plugins.ragen_resolvers: Hydra imports it as it starts, registering the resolver of
    # config/ (ragen.config_files.run_name)
    packages=find_packages(include=["ragen", "ragen.*"]) + ["hydra_plugins.ragen_resolvers"],
    # config/ (one copy of each YAML, read by train.py through Hydra) ships as
    # ragen/_config, a symlink to it in the source tree: see ragen/config_files.py
    package_data={"ragen": ["py.typed", "_config/*.yaml", "_config/*/*.yaml"]},
    install_requires=[
        "numpy>=1.24",
        "joblib>=1.4",
        "loky>=3.4",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        # Any torch >= 2.1 works (GPU users keep theirs); on a CPU-only machine
        # install torch==2.13.0 first, as the README's commands do.
        "torch>=2.1",
        "transformers>=4.46",
        "tokenizers>=0.20",
        "gguf>=0.10",  # to load the embedded default model (a GGUF file)
        "accelerate>=0.34",
        "safetensors",
        "peft>=0.13",
        "tqdm>=4.60",  # tqdm(delay=): the rollout progress bar shows only past 2 s
        "matplotlib",
        "websockets>=13",  # remote envs: OpenEnv's WebSocket session protocol, client and env server
        "urllib3>=2",  # the search env's pooled connections to its retrieval server
        "jsonschema>=4.18",  # tool schemas checked at config read, tool call arguments against them
        # train.py's allocator (trainer.allocator=auto, ragen.allocator): it gives an update's freed memory back
        "cmeel-mimalloc>=3.2; sys_platform == 'linux'",
        "regex>=2022.1.18",  # a tool schema's patterns, searched under a time limit (transformers needs it too)
    ],
    extras_require={
        # dask and ray too: their backends are tested in the default suite
        # gym + gym-sokoban and gymnasium: the tests run envs built on them the way
        # RAGEN's own modules are; gym-sokoban imports pkg_resources, which
        # setuptools 81 removed
        # pandas + pyarrow: the verl dataset builder (ragen.tools.verl_data) is tested there;
        # reasoning-gym, textarena: their env types are (the envs extra below)
        # datasets: RAGEN's own deepcoder and search modules load their (local) data with it
        "dev": ["pytest>=8", "pytest-timeout", "hypothesis>=6", "dask[distributed]", "ray",
                "gymnasium>=1.0", "gym==0.26.2", "gym-sokoban==0.0.6", "setuptools<81", "pandas", "pyarrow",
                "reasoning-gym==0.1.25", "textarena==0.7.4", "bm25s==0.3.16", "datasets",
                # clients of the gateway (tests/test_gateway*.py): the openai client and three agent frameworks
                "openai", "openai-agents", "langgraph", "langchain-openai", "smolagents"],
        # env libraries as env types, and the retrieval server's BM25 (docs/envs.md); the tests skip
        # theirs, naming the package, without
        "envs": ["reasoning-gym==0.1.25", "textarena==0.7.4", "bm25s==0.3.16"],
        "vllm": ["vllm"],
        # verl's trainer on ragen's envs (docs/verl.md); it pins transformers < 5.11 and
        # its own torch: install it in a venv of its own. cachetools, uvicorn, fastapi: verl
        # 0.9.1's agent loop imports them and its package does not declare them; openai: the
        # client agent programs call their gateway session with (the ragen_agent loop)
        "verl": ["verl==0.9.1", "pandas", "pyarrow", "cachetools", "uvicorn", "fastapi", "openai"],
        # verifiers environments as agent tags (docs/agents.md, *verifiers environments*); it pins
        # openai < 3 and the dev extra's openai-agents needs >= 3: install it in a venv of its own
        "verifiers": ["verifiers==0.4.0"],
        "dask": ["dask[distributed]"],
        "ray": ["ray[default]"],
    },
)
