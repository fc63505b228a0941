"""The storage root on a real S3 API server (moto on 127.0.0.1): checks with one-line errors, a
corpus published there and fetched by a node that never saw the original, trained from."""

import math
import shutil
from pathlib import Path

import pytest

from tests.workloads.lm.test_workload import nano_job
from workloads.core.registry import get_workload
from workloads.core.storage import StorageError, StorageRoot
from workloads.core.trial import Job
from workloads.lm.data.packing import token_dtype
from workloads.runtime.worker import run_in_process


def test_a_missing_bucket_and_an_unreachable_endpoint_are_one_line_errors(s3_server, tmp_path):
    StorageRoot(uri=str(tmp_path / "root")).check()
    assert (tmp_path / "root").is_dir()
    with pytest.raises(StorageError) as missing:
        StorageRoot(uri="s3://no-such-bucket/x", endpoint_url=s3_server).check()
    assert str(missing.value) == ("storage root s3://no-such-bucket/x: bucket 'no-such-bucket' "
                                  "does not exist")
    with pytest.raises(StorageError) as down:
        StorageRoot(uri="s3://b/x", endpoint_url="http://127.0.0.1:9").check()
    assert str(down.value).startswith("storage root s3://b/x: cannot reach the S3 API at "
                                      "http://127.0.0.1:9 (")
    assert "\n" not in str(down.value) and "cemlab-test" not in str(down.value)  # no secrets


def test_a_published_corpus_trains_on_a_node_that_only_has_the_bucket(
        s3_server, s3_bucket, corpus_glob, tmp_path, monkeypatch):
    storage = StorageRoot(uri=f"s3://{s3_bucket}/lab", endpoint_url=s3_server)
    storage.check()
    job = nano_job(corpus_glob, tmp_path / "host-a", micro=8, accum=1, steps=6)
    published = job.data.publish(storage)
    shards = [n for names in published.shards.values() for n in names]
    assert "train-00000.bin" in shards
    for name in shards + ["tokenizer.json", "manifest.json"]:
        assert storage.exists("data", published.name, name)
    assert published.localized(tmp_path / "elsewhere") is published  # this node has it

    # Host B: the original directory is gone; its workers fetch a node-local copy.
    shutil.rmtree(tmp_path / "host-a")
    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path / "host-b"))
    local = published.localized(tmp_path / "host-b" / "data")
    assert local.directory == str(tmp_path / "host-b" / "data" / published.name)
    assert local.n_tokens == published.n_tokens
    for split in local.shards:  # every shard arrived whole
        size = sum(Path(p).stat().st_size for p in local.paths(split))
        assert size == local.n_tokens[split] * token_dtype(300).itemsize
    final, _ = run_in_process(Job(job.trial, published), get_workload("language_model"))
    assert math.isfinite(final["test_perplexity"])
    assert (tmp_path / "host-b" / "data" / published.name / "manifest.json").exists()
