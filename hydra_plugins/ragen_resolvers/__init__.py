"""Registers the OmegaConf resolver of ragen's config/ (``ragen.run_name``, the name of a run's
experiment) when Hydra starts: Hydra imports every module of the ``hydra_plugins`` namespace
as it initializes, so a config composed by Hydra anywhere resolves."""

from ragen.config_files import register_resolvers

register_resolvers()
