"""docs/configuration.md is the reference `python -m trainer.config_reference` generates from the
typed configs: regenerate it when a setting changes."""

from __future__ import annotations

import dataclasses

from tests.conftest import REPO
from trainer.config import TrainConfig
from trainer.config_reference import reference


def test_the_configuration_reference_is_current() -> None:
    assert (REPO / "docs" / "configuration.md").read_text() == reference(), (
        "regenerate: python -m trainer.config_reference > docs/configuration.md")


def test_every_key_is_in_the_reference() -> None:
    text = reference()
    for group in dataclasses.fields(TrainConfig):
        for field in dataclasses.fields(group.default_factory()):  # type: ignore[misc]
            assert f"`{group.name}.{field.name}`" in text
