"""The one reader of a checkpoint's saved run config (YAML text: the record's `run_config`, or
`config` in its older format), and the one writer of a run config into anything written
(`unresolved_env`, `saved_yaml`).

A checkpoint may come from anyone, and its config is plain text anyone can edit, so it is read
as data only:
- without interpolation: every `${...}` is kept as the literal text (escaped for omegaconf), so
  `${oc.env:SECRET}` never reads the environment, and no resolver runs;
- with limits: no YAML anchors or aliases (a "billion laughs" expands a few lines into gigabytes;
  the trainer's `OmegaConf.to_yaml` never writes them), at most `MAX_BYTES` of text, `MAX_NODES`
  nodes and `MAX_DEPTH` levels, all checked on the parser's events before anything is built.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import (  # omegaconf is pinned to 2.3
    get_omega_conf_dumper,
    get_yaml_loader,
)
from omegaconf.errors import OmegaConfBaseException

# An interpolation that reads the environment: its value may be a secret (a token, a password),
# so nothing written resolves it (a checkpoint's saved config, an export's manifest, wandb).
# (an escaped `\${` is text: an odd number of backslashes before it)
ENV_INTERPOLATION = re.compile(r"(?<!\\)(?:\\\\)*\$\{\s*(oc\.env|env)\s*:")
MAX_BYTES = 1 << 20  # a run's config is a few KB
MAX_NODES = 100_000
MAX_DEPTH = 64


class SavedConfigError(ValueError):
    """The saved config is not a config this project writes (the message says why)."""


def read_saved_config(text: Any) -> DictConfig:
    """The saved config `text` as a DictConfig whose strings are all literal."""
    if not isinstance(text, str):
        raise SavedConfigError(f"the saved config is a {type(text).__name__}, not YAML text")
    if len(text) > MAX_BYTES:
        raise SavedConfigError(f"the saved config is {len(text)} characters long, over the "
                               f"limit of {MAX_BYTES} (a run's config is a few KB)")
    _check_events(text)
    try:  # omegaconf's own YAML rules (`1e-3` is a float), into plain Python values
        parsed = yaml.load(text, Loader=get_yaml_loader())
    except yaml.YAMLError as e:
        raise SavedConfigError(f"the saved config is not valid YAML: {_one_line(e)}") from None
    if not isinstance(parsed, dict):
        raise SavedConfigError("the saved config is not a mapping of settings")
    try:
        return OmegaConf.create(literal(parsed))
    except OmegaConfBaseException as e:
        raise SavedConfigError(f"the saved config is not a config: {_one_line(e)}") from None


def _check_events(text: str) -> None:
    """Refuse anchors, aliases and oversized or overdeep documents from the parser's events
    (cheap: nothing is expanded or built)."""
    nodes = depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise SavedConfigError(
                    "the saved config holds YAML anchors or aliases (&/*), which a saved config "
                    "never holds: refused, as they can expand without bound")
            if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
                nodes += 1
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            if nodes > MAX_NODES or depth > MAX_DEPTH:
                raise SavedConfigError(f"the saved config is over {MAX_NODES} values or "
                                       f"{MAX_DEPTH} levels deep (a run's config is far smaller)")
    except yaml.YAMLError as e:
        raise SavedConfigError(f"the saved config is not valid YAML: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def literal(value: Any) -> Any:
    """`value` with every string escaped so that omegaconf reads it as written: `${` becomes
    `\\${`, and the k backslashes before it 2k (omegaconf's escapes). Saved values (a
    checkpoint's record) go through it before they meet omegaconf."""
    if isinstance(value, dict):
        return {k: literal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [literal(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m[1])) + "\\${", value)
    return value


def unresolved_env(cfg: DictConfig) -> dict[str, Any]:
    """`cfg` as plain values for everything written: each interpolation resolved, except those
    that read the environment (`${oc.env:NAME}`), kept as their literal text, and so is any value
    interpolating one (`OmegaConf.to_container(cfg, resolve=True)` wrote the secret itself into
    the checkpoint's saved config, an export's manifest and wandb's files)."""
    raw = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)  # a choice: its name
    return OmegaConf.to_container(OmegaConf.create(_env_as_text(raw)), resolve=True)


def _env_as_text(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _env_as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_env_as_text(v) for v in value]
    if isinstance(value, str) and ENV_INTERPOLATION.search(value):
        return literal(value)
    return value


def saved_yaml(values: dict[str, Any]) -> str:
    """Plain config values (`unresolved_env`'s) as the YAML text a checkpoint saves, written as
    `OmegaConf.to_yaml` writes a config (an interpolation's text stays text: nothing parses it)."""
    return yaml.dump(values, default_flow_style=False, allow_unicode=True, sort_keys=False,
                     Dumper=get_omega_conf_dumper())


def written_settings(cfg: DictConfig) -> dict[str, Any]:
    """The `model`, `attention` and `run_config` of a run's checkpoint record: the run config as
    configured (`unresolved_env`: an environment interpolation stays its text; the run settings,
    the `trainer` group's kernel and DCA paths included, are there alone); the model and
    attention as built (resolved: they are the model), the model's free-text name excepted."""
    from models.schema import AttentionConfig, ModelConfig

    written = unresolved_env(cfg)
    model = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True) \
        | {"name": written["model"]["name"]}
    attention = OmegaConf.to_container(cfg.attention, resolve=True, enum_to_str=True)
    return {"model": ModelConfig(**model), "attention": AttentionConfig(**attention),
            "run_config": saved_yaml(written)}
