"""The base of every config section (hpcrl.config): strict keys, no inf or nan, and the errors a
section raises. No section is defined here."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict

PathStr = Annotated[str, "path"]  # resolved against the config file's directory


def _http_url(v: str) -> str:
    """`v` when empty (none) or an http(s) URL with a host and a valid port."""
    if not v:
        return v
    parts = urlsplit(v)
    try:
        parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
    except ValueError:
        raise ValueError("expected an http:// or https:// URL with a valid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL with a host, e.g. https://host.example.org:8443/path")
    return v


HttpUrl = Annotated[str, AfterValidator(_http_url)]  # empty, or an http(s) URL


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
