"""Where CEM Lab keeps its local state, from the ``CEMLAB_*`` environment (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Paths(BaseSettings):
    """``CEMLAB_HOME`` (default ``./.cemlab``, resolved against the current directory): the data
    cache, Ray results, the embedded MLflow store and local service state."""

    model_config = SettingsConfigDict(env_prefix="CEMLAB_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.cwd() / ".cemlab")

    @property
    def cemlab_home(self) -> Path:
        return self.home.resolve()

    @property
    def data_dir(self) -> Path:
        """Cache of downloaded corpora, tokenizers and token shards."""
        return self.cemlab_home / "data"
