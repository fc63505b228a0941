"""Result bundles: an experiment's finished trials as files that outlive the machine.

``cemlab export`` writes the FINISHED trials of named experiments into a directory, a bundle
that can be committed; ``cemlab import`` verifies one and records its trials FINISHED in this
ledger, where ``run`` then skips them (their trial ids are those the spec plans here, given the
same code and data) and ``report`` reads them. A bundle (``FORMAT`` 1) holds:

``experiments.parquet``
    One row per experiment: ``name``, ``workload``, ``spec_yaml`` (the spec text the ledger
    holds) and ``spec_sha256`` (of that text, UTF-8).
``trials.parquet``
    One row per finished trial, ordered by experiment and trial id (``TRIAL_SCHEMA``): the
    ledger's coordinates and metrics, ``source_experiment`` (the experiment that trained it,
    for a trial settled from the trial cache), ``code`` (the code fingerprint of its run, tag
    ``cemlab.code``; the exporter's ``code_fingerprint()`` where MLflow has no run for it),
    from its MLflow run ``params``, ``metrics`` (the last value of each) and ``history``
    (``{key: {step: value}}`` of every ``val_*``, ``test_*`` and ``test_time/*`` metric), all
    JSON, ``checkpoint_sha256`` (``checkpoint_digest`` of its checkpoint, where that is a
    readable local path), and the host and package versions of the machine that exported it
    (a trial's run does not record the host it trained on). A trial imported from a bundle
    keeps that bundle's run id, run fields, checkpoint digest, host and versions (``CARRIED``,
    held in its ledger row), so a bundle exported again after an import loses none of them;
    a trial settled from the cache of an imported one carries its source's.
``manifest.json``
    ``format``, ``created_at`` (UTC; ``SOURCE_DATE_EPOCH`` when set), ``code`` (the exporter's
    fingerprint), ``experiments``, ``trials`` (the row count), ``environment`` (the exporter's
    host and versions) and ``files``: the sha256 and byte size of every other file.

The Parquet files of one ledger and environment are the same bytes at every export (sorted
rows, no index, no write time), so a committed bundle changes only where its results do.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from mlflow import MlflowClient
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.records.ledger import IMPORTED_FIELDS, Imported, Ledger, Status
from orchestrator.records.tracking import CODE_TAG
from workloads.core.atomic import atomic_path
from workloads.core.provenance import code_fingerprint
from workloads.core.storage import StorageRoot

log = logging.getLogger(__name__)

FORMAT = 1
EXPERIMENTS, TRIALS, MANIFEST = "experiments.parquet", "trials.parquet", "manifest.json"
FILES = (EXPERIMENTS, TRIALS)  # a bundle's data files, each listed in its manifest
HISTORY_PREFIXES = ("val_", "test_")  # metrics kept with every evaluation (test_time/* too)
PACKAGES = ("torch", "ray", "deepspeed", "mlflow")  # versions recorded in a bundle
RUN_FIELDS = ("code", "params", "metrics", "history")  # from a trial's MLflow run
# what an imported trial carries in its ledger row (``record``) for its next export (``collect``)
CARRIED = ("mlflow_run_id", *RUN_FIELDS, "checkpoint_sha256", "host", "python_version",
           *[f"{name}_version" for name in PACKAGES])
_CHUNK = 2**20

EXPERIMENT_SCHEMA = pa.schema([
    ("name", pa.string()), ("workload", pa.string()), ("spec_yaml", pa.string()),
    ("spec_sha256", pa.string())])
_TIME = pa.timestamp("us", tz="UTC")
TRIAL_SCHEMA = pa.schema([
    ("experiment", pa.string()), ("trial_hash", pa.string()), ("dataset", pa.string()),
    ("variant", pa.string()), ("size", pa.string()), ("lr", pa.float64()),
    ("seed", pa.int64()), ("lr_round", pa.int64()), ("metric", pa.float64()),
    ("val_metric", pa.float64()), ("started_at", _TIME), ("finished_at", _TIME),
    ("source_experiment", pa.string()), ("mlflow_run_id", pa.string()),
    ("code", pa.string()), ("params", pa.string()), ("metrics", pa.string()),
    ("history", pa.string()), ("checkpoint_path", pa.string()),
    ("checkpoint_sha256", pa.string()), ("host", pa.string()),
    ("python_version", pa.string()),
    *[(f"{name}_version", pa.string()) for name in PACKAGES]])


class BundleError(RuntimeError):
    """A bundle that cannot be written or used; ``str()`` is one line naming the file and why."""


class FileEntry(BaseModel):
    """A bundle file's sha256 (hex) and size in bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class Manifest(BaseModel):
    """``manifest.json``: what a bundle holds and the checksum of every file in it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: int
    created_at: str
    code: str
    experiments: list[str]
    trials: int = Field(ge=0)
    environment: dict[str, str | None]
    files: dict[str, FileEntry]


@dataclass(frozen=True)
class Bundle:
    """A bundle read back and verified (``read_bundle``): its manifest and rows (times naive
    UTC, as the ledger stores them)."""

    manifest: Manifest
    experiments: list[dict[str, Any]]
    trials: list[dict[str, Any]]

    def run_metrics(self) -> dict[str, dict[str, float]]:
        """Each trial's MLflow run id -> its final metrics, for the trials that have both."""
        return {t["mlflow_run_id"]: json.loads(t["metrics"]) for t in self.trials
                if t["mlflow_run_id"] and t["metrics"]}


def environment() -> dict[str, str | None]:
    """This machine's host name and the versions of Python and of ``PACKAGES`` (None where a
    package is not installed); read from package metadata, importing none of them."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"host": socket.gethostname(), "python": platform.python_version(),
            **{name: version(name) for name in PACKAGES}}


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_digest(uri: str | None, storage: StorageRoot | None) -> str | None:
    """Hex sha256 of a checkpoint: over each file under it (or the one file it is), in path
    order, of ``<relative path>\\0<sha256 of the file>\\n``. ``uri`` is a ledger
    ``checkpoint_path``: a URI under ``storage`` (a local root) or a local path. None where it
    is not a readable local path (an ``s3://`` checkpoint is not downloaded to be hashed)."""
    if not uri or uri.startswith("s3://"):
        return None
    local = (storage.path_of_uri(uri) if storage is not None and not storage.is_remote
             else None) or uri
    path = Path(local)
    try:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            return None
        h = hashlib.sha256()
        for f in files:
            name = f.name if f == path else f.relative_to(path).as_posix()
            h.update(f"{name}\0{sha256_file(f)}\n".encode())
        return h.hexdigest()
    except OSError as e:
        log.info("checkpoint %s not hashed: %s", uri, e.strerror or e)
        return None


def _json(value: Any) -> str:
    """``value`` as compact JSON, keys sorted (the same text for the same value)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def run_record(client: MlflowClient, run_id: str) -> dict[str, str | None]:
    """What a trial's MLflow run ``run_id`` adds to its bundle row: ``code`` (its
    ``cemlab.code`` tag, or None), ``params``, ``metrics`` (the last value of each) and
    ``history`` (``{key: {step: value}}`` of the ``HISTORY_PREFIXES`` metrics, the latest
    value at a step repeated by a resumed run), each as JSON.

    Raises:
        mlflow.exceptions.MlflowException: no such run, or the store refused.
    """
    run = client.get_run(run_id)
    history = {}
    for key in sorted(k for k in run.data.metrics if k.startswith(HISTORY_PREFIXES)):
        points = sorted(client.get_metric_history(run_id, key),
                        key=lambda m: (m.step, m.timestamp))
        history[key] = {str(m.step): m.value for m in points}
    return {"code": run.data.tags.get(CODE_TAG), "params": _json(dict(run.data.params)),
            "metrics": _json(dict(run.data.metrics)), "history": _json(history)}


def tracking_client(uri: str | None) -> MlflowClient | None:
    """An ``MlflowClient`` of ``uri`` if its store answers within 5 s, else None, said in one
    log line (a bundle is then written from the ledger alone)."""
    if uri is None:
        log.info("no MLflow tracking store here: exporting the ledger's fields only")
        return None
    from workloads.core.reach import check_tracking

    try:
        check_tracking(uri, timeout_s=5)
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)
    except Exception as e:  # a bundle needs no MLflow
        log.warning("MLflow at %s unavailable (%s): exporting the ledger's fields only; "
                    "code, params, metrics and history are left empty", uri,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    return client


def _utc(t: dt.datetime | None) -> dt.datetime | None:
    """A ledger time (naive UTC) as an aware UTC datetime."""
    return None if t is None else t.replace(tzinfo=dt.UTC)


def collect(ledger: Ledger, names: list[str], client: MlflowClient | None = None,
            storage: StorageRoot | None = None) -> tuple[list[dict], list[dict]]:
    """The experiment and trial rows of a bundle of experiments ``names`` (``TRIAL_SCHEMA``,
    ``EXPERIMENT_SCHEMA``): their FINISHED trials, with their runs' data where ``client``
    has the run, sorted by experiment and trial id.

    Raises:
        BundleError: a name the ledger has no experiment of.
    """
    env = environment()
    here = code_fingerprint()
    experiments, trials, unread = [], [], 0
    name_of = {e.id: e.name for e in ledger.experiments()}
    for name in sorted(set(names)):
        exp = ledger.experiment(name)
        if exp is None:
            known = ", ".join(name_of.values()) or "none"
            raise BundleError(f"no experiment '{name}' in the ledger {ledger.shown_url} "
                              f"(known: {known})")
        experiments.append({"name": exp.name, "workload": exp.workload,
                            "spec_yaml": exp.spec_yaml,
                            "spec_sha256": hashlib.sha256(exp.spec_yaml.encode()).hexdigest()})
        rows = [r for r in ledger.trials(exp.id) if r.status == Status.FINISHED]
        sources = {r.id: r for r in ledger.rows_of_trials(
            {r.trial_hash for r in rows if r.source_trial_id is not None})}
        for r in rows:
            record: dict[str, str | None] = dict.fromkeys(RUN_FIELDS)
            if client is not None and r.mlflow_run_id:
                try:
                    record = run_record(client, r.mlflow_run_id)
                except Exception as e:  # a deleted run, or a store gone: its fields stay empty
                    unread += 1
                    log.info("trial %s: MLflow run %s not read (%s)", r.trial_hash,
                             r.mlflow_run_id, str(e).splitlines()[0] if str(e) else e)
            source = sources.get(r.source_trial_id)
            row = {
                "experiment": exp.name, "trial_hash": r.trial_hash, "dataset": r.dataset,
                "variant": r.variant, "size": r.size, "lr": r.lr, "seed": r.seed,
                "lr_round": r.lr_round, "metric": r.metric, "val_metric": r.val_metric,
                "started_at": _utc(r.started_at), "finished_at": _utc(r.finished_at),
                "source_experiment": source and name_of[source.experiment_id],
                "mlflow_run_id": r.mlflow_run_id, **record,
                "checkpoint_path": r.checkpoint_path,
                "checkpoint_sha256": checkpoint_digest(r.checkpoint_path, storage),
                "host": env["host"], "python_version": env["python"],
                **{f"{p}_version": env[p] for p in PACKAGES}}
            carried = r.carried or (source.carried if source and not r.mlflow_run_id else None)
            if carried and not any(record.values()):  # imported here, or a copy of one
                row.update(json.loads(carried))
            trials.append({**row, "code": row["code"] or here})
    if unread:
        log.warning("%d trial run(s) not read from MLflow: their code, params, metrics and "
                    "history are left empty", unread)
    trials.sort(key=lambda t: (t["experiment"], t["trial_hash"]))
    return experiments, trials


def created_at() -> str:
    """Now (UTC, ISO 8601, seconds), or ``SOURCE_DATE_EPOCH`` when set (reproducible builds'
    convention: a bundle whose manifest is the same bytes at every export)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    now = (dt.datetime.fromtimestamp(int(epoch), dt.UTC) if epoch
           else dt.datetime.now(dt.UTC))
    return now.replace(microsecond=0).isoformat()


def _write_parquet(rows: list[dict], schema: pa.Schema, path: Path) -> None:
    """``rows`` as a Parquet file of ``schema`` (zstd, no pandas index or metadata)."""
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, compression="zstd")


def _replaceable(out: Path) -> None:
    """Check that ``out`` is absent, empty, or a bundle (only bundle files): export replaces
    it whole, and must never remove anything else.

    Raises:
        BundleError: ``out`` is a file, or a directory holding other files.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise BundleError(f"{out}: exists and is not a directory")
    others = sorted(p.name for p in out.iterdir() if p.name not in (*FILES, MANIFEST))
    if others:
        raise BundleError(f"{out}: not a bundle directory (holds {', '.join(others[:5])}); "
                          "export replaces its directory whole: give a new or bundle directory")


def write_bundle(out: Path, experiments: list[dict], trials: list[dict]) -> Manifest:
    """Write a bundle of ``experiments`` and ``trials`` (``collect``) into directory ``out``,
    replacing any bundle there whole: the files are written into a new directory beside it,
    the manifest last, which then takes ``out``'s place (the old one is renamed aside first
    and removed after). At no time is ``out`` a partial bundle.

    Raises:
        BundleError: ``out`` is neither absent, empty nor a bundle (``_replaceable``).
        OSError: the files could not be written (nothing at ``out`` changed).
    """
    out = Path(out)
    _replaceable(out)
    aside = None
    try:
        with atomic_path(out) as tmp:
            tmp.mkdir()
            _write_parquet(experiments, EXPERIMENT_SCHEMA, tmp / EXPERIMENTS)
            _write_parquet(trials, TRIAL_SCHEMA, tmp / TRIALS)
            manifest = Manifest(
                format=FORMAT, created_at=created_at(), code=code_fingerprint(),
                experiments=[e["name"] for e in experiments], trials=len(trials),
                environment=environment(),
                files={name: FileEntry(sha256=sha256_file(tmp / name),
                                       bytes=(tmp / name).stat().st_size) for name in FILES})
            (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=1) + "\n")
            if out.exists():
                aside = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.old")
                os.replace(out, aside)
    except BaseException:
        if aside is not None and not out.exists():
            os.replace(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return manifest


def export_bundle(ledger: Ledger, names: list[str], out: Path,
                  client: MlflowClient | None = None,
                  storage: StorageRoot | None = None) -> Manifest:
    """Write the FINISHED trials of experiments ``names`` in ``ledger`` as a bundle in ``out``
    (``collect``, then ``write_bundle``), their runs read through ``client`` (None: the
    ledger's fields only) and checkpoints hashed under ``storage``.

    Raises:
        BundleError: an unknown experiment, or ``out`` is not a bundle directory.
    """
    experiments, trials = collect(ledger, names, client, storage)
    return write_bundle(Path(out), experiments, trials)


def _read_table(path: Path, schema: pa.Schema) -> list[dict]:
    """The rows of the Parquet file at ``path``, whose columns must be ``schema``'s.

    Raises:
        BundleError: not a Parquet file, or other columns.
    """
    try:
        table = pq.read_table(path)
    except pa.ArrowException as e:
        raise BundleError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})"
                          ) from None
    if not table.schema.equals(schema):
        raise BundleError(f"{path}: columns {table.schema.names} are not those of bundle "
                          f"format {FORMAT}")
    return table.to_pylist()


def read_bundle(directory: Path) -> Bundle:
    """The bundle in ``directory``, verified: a manifest of this ``FORMAT`` listing every data
    file, each present with its size and sha256, the rows those the manifest counts.

    Raises:
        BundleError: one line naming the file at fault (missing, altered, unreadable).
    """
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise BundleError(f"{path}: missing (not a bundle)") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "manifest"
        raise BundleError(f"{path}: {where}: {err['msg']}") from None
    if manifest.format != FORMAT:
        raise BundleError(f"{path}: bundle format {manifest.format}, this code reads "
                          f"{FORMAT}")
    for name in FILES:
        if name not in manifest.files:
            raise BundleError(f"{path}: lists no {name}")
    for name, entry in sorted(manifest.files.items()):
        file = directory / name
        if Path(name).name != name:
            raise BundleError(f"{path}: lists {name!r}, not a file name of the bundle")
        if not file.is_file():
            raise BundleError(f"{file}: missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != entry.bytes or sha256_file(file) != entry.sha256:
            raise BundleError(f"{file}: checksum mismatch ({size} bytes; {MANIFEST} lists "
                              f"{entry.bytes} bytes, sha256 {entry.sha256[:12]}...): altered "
                              "or cut short")
    experiments = _read_table(directory / EXPERIMENTS, EXPERIMENT_SCHEMA)
    trials = _read_table(directory / TRIALS, TRIAL_SCHEMA)
    names = [e["name"] for e in experiments]
    if names != manifest.experiments or len(trials) != manifest.trials:
        raise BundleError(f"{path}: lists {manifest.trials} trial(s) of {manifest.experiments}"
                          f", the files hold {len(trials)} of {names}")
    strays = sorted({t["experiment"] for t in trials} - set(names))
    if strays:
        raise BundleError(f"{directory / TRIALS}: trials of experiment(s) {strays} that "
                          f"{EXPERIMENTS} does not hold")
    for t in trials:
        for key in ("started_at", "finished_at"):
            if t[key] is not None:
                t[key] = t[key].astimezone(dt.UTC).replace(tzinfo=None)
    return Bundle(manifest, experiments, trials)


def find_bundles(path: Path) -> list[Path]:
    """The bundle directories at ``path``: ``path`` itself where it holds a ``MANIFEST``, else
    its immediate sub-directories that do, in name order; none where ``path`` is absent or
    not a directory. Nothing is verified here (``read_bundle`` does)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if (p / MANIFEST).is_file())


def code_drift(bundle: Bundle, code: str | None = None) -> str | None:
    """Why ``bundle``'s trials are not this code's (``code``, default ``code_fingerprint()``),
    in one line, or None when every trial was computed by it: a trial id includes the code
    fingerprint, so another code's trials are never the ones this code plans."""
    code = code or code_fingerprint()
    other = sorted({t["code"] for t in bundle.trials} - {code})
    if not other:
        return None
    n = sum(t["code"] != code for t in bundle.trials)
    return (f"{n} of {len(bundle.trials)} trial(s) were computed by code {', '.join(other)}, "
            f"this code is {code}: run would not find them (their trial ids differ)")


def check_bundle(directory: Path, allow_code_drift: bool = False) -> Bundle:
    """The bundle in ``directory``, verified (``read_bundle``) and, unless
    ``allow_code_drift``, refused when its trials are another code's (``code_drift``).

    Raises:
        BundleError: one line: the file that does not verify, or the code that differs.
    """
    bundle = read_bundle(directory)
    drift = code_drift(bundle)
    if drift and not allow_code_drift:
        raise BundleError(f"{directory}: {drift}; pass --allow-code-drift to import them "
                          "anyway")
    return bundle


def record(bundle: Bundle, ledger: Ledger, keep_run_ids: bool = False) -> Imported:
    """Record ``bundle``'s trials FINISHED in ``ledger``, in one transaction
    (``Ledger.import_finished``: missing experiments created with the bundle's spec text,
    trials FINISHED there already left as they are). The rows get no MLflow run, since theirs
    belong to another tracking store, unless ``keep_run_ids`` (a ledger made to render a
    report from bundles, whose metrics then come from ``Bundle.run_metrics``); each keeps the
    bundle's other fields (``CARRIED``) in its ``carried`` column, which ``collect`` gives
    back."""
    experiments = {e["name"]: (e["workload"], e["spec_yaml"]) for e in bundle.experiments}
    trials = [{"experiment": t["experiment"], "trial_hash": t["trial_hash"],
               "source_experiment": t["source_experiment"],
               "mlflow_run_id": t["mlflow_run_id"] if keep_run_ids else None,
               "carried": json.dumps({k: t[k] for k in CARRIED}, sort_keys=True),
               **{k: t[k] for k in IMPORTED_FIELDS}} for t in bundle.trials]
    return ledger.import_finished(experiments, trials)


def import_bundle(directory: Path, ledger: Ledger, allow_code_drift: bool = False) -> Imported:
    """``check_bundle``, then ``record`` into ``ledger``: nothing is written when the bundle
    does not verify. Trials of another code, imported with ``allow_code_drift``, serve
    reports (``report`` reads trials by their grid point), but ``run`` trains this code's own
    (their trial ids differ).

    Raises:
        BundleError: the bundle does not verify, or its trials are another code's.
    """
    return record(check_bundle(directory, allow_code_drift), ledger)
