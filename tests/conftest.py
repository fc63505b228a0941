"""Shared fixtures: small real corpora written to disk."""

import random
from pathlib import Path

import pytest

WORDS = ("the king queen crown sword night day love death honour speak hear thou thee my lord "
         "lady fair foul sweet bitter cold warm house field river stone ship sea").split()


def write_corpus(directory: Path, n_docs: int = 12, words_per_doc: int = 4000,
                 seed: int = 0) -> str:
    """``n_docs`` text files of pseudo-English (a skewed word distribution); returns a glob."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(WORDS))]
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        lines = []
        for _ in range(words_per_doc // 10):
            lines.append(" ".join(rng.choices(WORDS, weights, k=10)) + ".")
        (directory / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
    return str(directory / "*.txt")


@pytest.fixture
def corpus_glob(tmp_path: Path) -> str:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server (moto) on 127.0.0.1, with test credentials in the environment;
    yields its endpoint URL. Buckets are made per test (``s3_bucket``)."""
    import os

    from moto.server import ThreadedMotoServer

    os.environ.update(AWS_ACCESS_KEY_ID="cemlab-test", AWS_SECRET_ACCESS_KEY="cemlab-test",
                      AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    """A fresh, empty bucket on ``s3_server``; returns its name."""
    import uuid

    import boto3

    name = f"cemlab-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name
