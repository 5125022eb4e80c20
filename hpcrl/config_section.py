"""The base of every config section (hpcrl.config): strict keys, no inf or nan, and the errors a
section raises. No section is defined here."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict

PathStr = Annotated[str, "path"]  # resolved against the config file's directory


class ConfigError(ValueError):
    """A config that cannot run; the message names the file, the key and what was expected."""


class Rule(ValueError):
    """A section's cross-key rule, broken: names the key (within the section) and what was expected."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class Section(BaseModel):
    # allow_inf_nan: no key takes inf or nan (update.lr = inf once trained a non-finite policy)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
