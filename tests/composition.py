"""`compose_config`: a run's config as `python -m trainer <overrides>` composes it, for the tests'
~300 compositions, at ~0.01 s instead of Hydra's ~0.1-0.2 s each.

Hydra composes in two stages (hydra/_internal/config_loader_impl.py, `_load_configuration_impl`):
the defaults list, which only the config-group overrides (`model=...`, `+attention=...`) change,
is built and merged; then every other override is applied to that config, in order, by
`ConfigLoaderImpl._apply_overrides_to_config`. The first stage is the slow one and the tests
repeat a few dozen group selections, so it is cached per group selection; the second stage runs
as Hydra runs it, on a copy, with Hydra's own parser and function, so a misspelt key, a wrong
type or a missing `+` fails exactly as in a full composition. Overrides of Hydra's own node
(`hydra.*`) and sweeps compose in full. tests/test_composition.py checks the result equals
Hydra's, errors included."""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

from trainer.config import CONF_DIR

if TYPE_CHECKING:
    from omegaconf import DictConfig


def compose_in_full(overrides: list[str]) -> DictConfig:
    """Hydra's own composition, every stage, nothing cached."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@functools.cache
def _composed_defaults(group_overrides: tuple[str, ...]) -> DictConfig:
    """The first stage's result for these group overrides (only read: callers get copies)."""
    return compose_in_full(list(group_overrides))


@functools.cache
def _group_exists(name: str) -> bool:
    """Whether `name` is a config group of conf/ (or Hydra's): Hydra's own test, which decides
    whether an override selects a config (defaults list) or sets a value."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return GlobalHydra.instance().hydra.config_loader.repository.group_exists(name)


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The run's config exactly as `python -m trainer <overrides>` composes it."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = list(overrides or [])
    parsed = OverridesParser.create().parse_overrides(overrides)
    if any(o.is_sweep_override() or o.is_hydra_override() for o in parsed):
        return compose_in_full(overrides)
    # the partition of hydra/_internal/defaults_list.py's `Overrides`: a dict value or a key
    # that is not a group is a value override
    is_group = [_group_exists(o.key_or_group) and not isinstance(o.value(), dict)
                for o in parsed]
    groups = [o for o, group in zip(parsed, is_group) if group]
    values = [o for o, group in zip(parsed, is_group) if not group]
    cfg = copy.deepcopy(_composed_defaults(tuple(o.input_line for o in groups)))
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)  # the second stage, as Hydra runs it
    return cfg
