"""One pass over a document source: a per-batch function applied to every document, results
in source order. On a Ray cluster (``ray.is_initialized()``) the pass is a Ray Data pipeline
(parts read in parallel tasks, pinned to this node when the source's files are local; the
function in parallel ``map_batches`` tasks on any node; ``preserve_order``); without Ray, or
for a source whose files here hold at most ``IN_PROCESS_BYTES`` (the embedded corpus: 5 MB),
it runs in this process: Ray Data's worker processes take seconds to start, longer than such a
pass. Either way the results, concatenated, are the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from workloads.lm.data.sources import Document, DocumentSource

Batch = dict[str, np.ndarray]  # column name -> array over the batch's rows
BatchFn = Callable[..., Batch]

BATCH_DOCUMENTS = 256
IN_PROCESS_BYTES = 64 * 2**20  # a node-local source this small is read and processed here


def as_batch(docs: list[Document]) -> Batch:
    """``{"doc_id": (n,) object, "text": (n,) object}``."""
    return {"doc_id": np.array([d.doc_id for d in docs], dtype=object),
            "text": np.array([d.text for d in docs], dtype=object)}


def scan(source: DocumentSource, fn: BatchFn | None = None, fn_kwargs: dict | None = None, *,
         tasks: int | None = None, batch_documents: int = BATCH_DOCUMENTS) -> Iterator[Batch]:
    """``fn(batch, **fn_kwargs)`` for consecutive batches of ``source``'s documents (the batches
    themselves when ``fn`` is None), in order. ``fn`` must treat documents independently:
    batch boundaries differ between runs. ``tasks`` caps the parallel Ray tasks of each stage
    (None: as many as Ray schedules, or none for a source small enough to run in this process,
    ``in_process``); ignored without Ray. Stopping early is allowed."""
    if not ray_running() or (tasks is None and in_process(source)):
        for part in source.parts():
            for docs in source.read(part):
                batch = as_batch(docs)
                yield fn(batch, **(fn_kwargs or {})) if fn else batch
        return
    yield from _ray_scan(source, fn, fn_kwargs or {}, tasks, batch_documents)


def ray_running() -> bool:
    """Whether this process is connected to Ray; False where Ray is not installed (a GPU
    machine with torch alone runs ``python -m workloads.runtime.worker``)."""
    try:
        import ray
    except ModuleNotFoundError:
        return False
    return ray.is_initialized()


def in_process(source: DocumentSource) -> bool:
    """Whether ``source`` is small enough for one pass in this process to beat Ray Data's: its
    files are on this node and hold at most ``IN_PROCESS_BYTES``."""
    size = source.local_bytes() if source.node_local else None
    return size is not None and size <= IN_PROCESS_BYTES


def _read_parts(batch: Batch, source: DocumentSource) -> Iterator[Batch]:
    for part in batch["part"]:
        for docs in source.read(json.loads(part)):
            yield as_batch(docs)


@contextmanager
def _ordered() -> Iterator[None]:
    from ray.data import DataContext

    options = DataContext.get_current().execution_options
    before, options.preserve_order = options.preserve_order, True
    try:
        yield
    finally:
        options.preserve_order = before


def _ray_scan(source: DocumentSource, fn: BatchFn | None, fn_kwargs: dict, tasks: int | None,
              batch_documents: int) -> Iterator[Batch]:
    import ray

    here = None
    if source.node_local:  # its files are on this node only: Ray's per-node resource pins
        here = {f"node:{ray.util.get_node_ip_address()}": 0.001}
    parts = [{"part": json.dumps(p)} for p in source.parts()]
    pool = ray.data.TaskPoolStrategy(size=tasks)
    with _ordered():
        ds = ray.data.from_items(parts, override_num_blocks=len(parts)).map_batches(
            _read_parts, batch_size=1, fn_kwargs={"source": source}, compute=pool,
            resources=here)
        if fn is not None:
            ds = ds.map_batches(fn, batch_size=batch_documents, fn_kwargs=fn_kwargs,
                                compute=pool)
        yield from ds.iter_batches(batch_size=None, batch_format="numpy")
