"""The storage root: one place every node reaches, for everything a trial needs or leaves behind.

A local directory on a laptop (the default, ``$CEMLAB_HOME``), or an object store,
``s3://bucket/prefix``, with an optional S3 API endpoint (``CEMLAB_S3_ENDPOINT_URL``: MinIO, a
test server, another cloud's S3 API). Under it:

    data/corpus-<key>/   token shards, tokenizer.json and manifest.json of a prepared corpus
    ray_results/         Ray Train checkpoints (trials/<experiment>/trial-<id>/) and Ray Tune
                         state (tune/)
    mlartifacts/         MLflow's artifacts (models), written by the tracking server (up.sh)

Credentials come from the standard AWS environment (``AWS_ACCESS_KEY_ID``, ...) of each node;
they never travel in a ``StorageRoot``. Files move with ``pyarrow.fs`` (what Ray Train uses).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict

from workloads.core.atomic import atomic_path
from workloads.core.reach import ServiceError


class StorageError(ServiceError):
    """A storage root that cannot be used; ``str()`` is one line naming the cause."""


class StorageRoot(BaseModel):
    """``uri``: an absolute local path, or ``s3://bucket[/prefix]``; ``endpoint_url``: the S3
    API server of an ``s3://`` root (None: AWS's own)."""

    model_config = ConfigDict(frozen=True)

    uri: str
    endpoint_url: str | None = None

    @property
    def is_remote(self) -> bool:
        return self.uri.startswith("s3://")

    @property
    def root(self) -> str:
        """The root's path on its filesystem, without a scheme (``bucket/prefix`` for S3: what
        Ray Train's ``RunConfig(storage_path=..., storage_filesystem=...)`` takes)."""
        if self.is_remote:
            return self.uri.removeprefix("s3://").rstrip("/")
        return str(Path(self.uri).resolve())

    def filesystem(self):
        """``(pyarrow filesystem, root)``."""
        import pyarrow.fs as pafs

        if not self.is_remote:
            return pafs.LocalFileSystem(), self.root
        parsed = urlparse(self.endpoint_url or "")
        s3 = pafs.S3FileSystem(
            endpoint_override=parsed.netloc or None, scheme=parsed.scheme or "https",
            region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            connect_timeout=5, request_timeout=60)
        return s3, self.root

    def path(self, *parts: str) -> str:
        """The filesystem path (no scheme) of ``parts`` under the root."""
        return "/".join([self.root, *parts])

    def uri_of(self, *parts: str) -> str:
        """The URI of ``parts`` under the root (``s3://...`` or a local path)."""
        return "/".join([self.uri.rstrip("/"), *parts])

    def path_of_uri(self, uri: str) -> str | None:
        """The filesystem path (no scheme) of ``uri`` (a ``uri_of``), or None when ``uri``
        is not under this root."""
        prefix = self.uri.rstrip("/") + "/"
        return self.path(uri.removeprefix(prefix)) if uri.startswith(prefix) else None

    def check(self) -> None:
        """Fail fast on a root nobody can write.

        Raises:
            StorageError: the endpoint does not answer, the bucket does not exist, or a local
                root cannot be created (one line, no credentials in it).
        """
        import pyarrow.fs as pafs

        fs, root = self.filesystem()
        if not self.is_remote:
            try:
                Path(root).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StorageError(f"storage root {self.uri}: {e.strerror}") from None
            return
        bucket = root.split("/", 1)[0]
        try:
            info = fs.get_file_info(bucket)
        except OSError as e:
            where = f" at {self.endpoint_url}" if self.endpoint_url else ""
            reason = str(e).split(";")[0].split(" during ")[0].split("AWS Error ")[-1]
            raise StorageError(f"storage root {self.uri}: cannot reach the S3 API{where} "
                               f"({reason})") from None
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"storage root {self.uri}: bucket '{bucket}' does not exist")

    def exists(self, *parts: str) -> bool:
        import pyarrow.fs as pafs

        fs, _ = self.filesystem()
        return fs.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound

    def upload(self, files: dict[str, str | os.PathLike], *parts: str) -> None:
        """Copy local files to ``parts`` under the root, each under its key's name, in the
        order given (put a manifest last: its presence then means the rest is there)."""
        import pyarrow.fs as pafs

        fs, _ = self.filesystem()
        target = self.path(*parts)
        fs.create_dir(target, recursive=True)
        local_fs = pafs.LocalFileSystem()
        for name, local in files.items():
            pafs.copy_files(str(local), f"{target}/{name}", source_filesystem=local_fs,
                            destination_filesystem=fs)

    def download(self, local_dir: str | os.PathLike, *parts: str) -> None:
        """Copy the files under ``parts`` into the new directory ``local_dir``, atomically: it is
        complete or absent."""
        import pyarrow.fs as pafs

        fs, _ = self.filesystem()
        with atomic_path(local_dir) as staging:
            staging.mkdir()
            pafs.copy_files(self.path(*parts), str(staging), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
