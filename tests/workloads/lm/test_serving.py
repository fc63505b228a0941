"""Model packages and their pyfunc: safetensors round trips, scoring against an independent NLL,
reproducible sampling, and no pickle anywhere in what is written or on any load path."""

import ast
import math
import os
import pickle
import re
import zipfile
from pathlib import Path

import mlflow.pyfunc
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from workloads.lm.data.sources import Document
from workloads.lm.data.tokenizer import EOT, train_tokenizer
from workloads.lm.package import load_decoder, save_package
from workloads.lm.serving import save_pyfunc
from workloads.models import ModelConfig, build_model
from workloads.models.inference import generate, token_nll
from workloads.models.test_time import Steps, at_steps
from workloads.runtime.engine import load_weights_only

ROOT = Path(__file__).resolve().parents[3]
TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    docs = [Document(str(i), TEXT[i:] + " " + TEXT[:i]) for i in range(0, 150, 3)]
    return train_tokenizer(docs, 320, tmp_path_factory.mktemp("tok"))[1]


def trained_like(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A model with weights far from init (so that every tensor matters to its outputs)."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("variant", [{}, {"attention": "cem", "mlp": "cem", "attn_steps": 2,
                                          "kq_diag": "shared"}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_package_loads_back_bit_identical_in_its_dtype(tmp_path, tokenizer_json, variant, dtype):
    cfg = ModelConfig.from_preset("nano", vocab_size=320, **variant)
    model = trained_like(cfg).to(dtype)
    save_package(model, tokenizer_json, tmp_path)
    loaded = load_decoder(tmp_path)
    assert loaded.cfg == cfg and not loaded.training
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(theirs[k].dtype == dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    x = torch.randint(320, (2, 16))
    assert torch.equal(model(x), loaded(x))


def test_scoring_predicts_every_token_once_as_an_independent_nll_does(tokenizer_json):
    cfg = ModelConfig.from_preset("nano", vocab_size=320)
    model = trained_like(cfg)
    ids = torch.randint(320, (3 * cfg.context_length + 5,)).tolist()  # four windows
    count, nll = token_nll(model, ids)
    assert count == len(ids) - 1
    # Independently: each token from at most context_length tokens before it, window by window.
    expected = 0.0
    for start in range(0, len(ids) - 1, cfg.context_length):
        x = torch.tensor(ids[start:start + cfg.context_length + 1])
        with torch.no_grad():
            logp = F.log_softmax(model(x[None, :-1])[0].double(), -1)
        expected -= sum(logp[i, x[i + 1]].item() for i in range(len(x) - 1))
    assert nll == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        token_nll(model, ids[:1])


def test_sampling_is_seeded_greedy_at_temperature_zero_and_stops_at_end_of_text():
    cfg = ModelConfig.from_preset("nano", vocab_size=320)
    model = trained_like(cfg)
    prompt = [1, 2, 3]
    a = generate(model, prompt, 20, temperature=1.0, seed=7)
    assert a == generate(model, prompt, 20, temperature=1.0, seed=7) and len(a) == 20
    assert a != generate(model, prompt, 20, temperature=1.0, seed=8)
    greedy, ids = generate(model, prompt, 10, temperature=0.0), list(prompt)
    for _ in range(10):  # the argmax loop, written out
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy == ids[3:] == generate(model, prompt, 10, temperature=1.0, top_k=1, seed=3)
    first = greedy[0]
    assert generate(model, prompt, 10, temperature=0.0, stop_id=first) == []
    # A prompt longer than the context conditions on its last context_length tokens.
    long = torch.randint(320, (cfg.context_length + 9,)).tolist()
    assert generate(model, long, 3, temperature=0.0) == generate(
        model, long[-cfg.context_length:], 3, temperature=0.0)


def test_the_pyfunc_scores_and_generates_and_holds_no_pickle(tmp_path, tokenizer_json):
    cfg = ModelConfig.from_preset("nano", vocab_size=320, attention="cem", mlp="cem")
    model = trained_like(cfg).to(torch.bfloat16)
    save_pyfunc(model, tokenizer_json, tmp_path / "model")
    for path in (tmp_path / "model").rglob("*"):  # no pickle, no torch zip (which pickles)
        if path.is_file():
            head = path.read_bytes()[:2]
            assert head[:1] != b"\x80" and not zipfile.is_zipfile(path), path
    assert (tmp_path / "model" / "code" / "workloads" / "lm" / "serving.py").is_file()
    pyfunc = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    out = pyfunc.predict(pd.DataFrame({"text": [TEXT, "To be"]}))
    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = [tok.token_to_id(EOT), *tok.encode(TEXT).ids]
    count, nll = token_nll(model, ids)
    assert list(out.columns) == ["token_count", "nll", "perplexity"]
    assert out["token_count"][0] == count == len(ids) - 1
    assert out["nll"][0] == pytest.approx(nll) and out["perplexity"][0] == pytest.approx(
        math.exp(nll / count))
    params = {"task": "generate", "max_new_tokens": 12, "temperature": 0.9, "top_k": 20,
              "seed": 5}
    gen = pyfunc.predict(pd.DataFrame({"text": ["To be, or not"]}), params=params)
    expected = generate(model, [tok.token_to_id(EOT), *tok.encode("To be, or not").ids], 12,
                        0.9, 20, 5, stop_id=tok.token_to_id(EOT))
    assert gen["continuation"][0] == tok.decode(expected)
    with pytest.raises(Exception, match="task must be"):
        pyfunc.predict(pd.DataFrame({"text": ["x"]}), params={"task": "translate"})
    # test-time recursion: the scores of the model at 2 steps, its own with params at 1
    deeper = pyfunc.predict(pd.DataFrame({"text": [TEXT]}),
                            params={"attn_steps": 2, "mlp_steps": 2, "step_size_scale": 0.5})
    _, nll_t2 = token_nll(at_steps(model, Steps(2, 2, 0.5)), ids)
    assert deeper["nll"][0] == pytest.approx(nll_t2) and nll_t2 != pytest.approx(nll)
    same = pyfunc.predict(pd.DataFrame({"text": [TEXT]}), params={"attn_steps": 1})
    assert same["nll"][0] == out["nll"][0]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_checkpoint_loads_refuse_a_pickle_that_runs_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"step": 1, "payload": _Payload()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_weights_only(str(tmp_path / "evil.pt"))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "evil.pt", weights_only=True)  # what the torch engine uses
    assert not (tmp_path / "PWNED").exists()


def test_no_load_path_unpickles():
    """Our code never calls a loader that unpickles: pickle/cloudpickle/joblib loads,
    ``torch.load`` without ``weights_only=True``, ``mlflow.pytorch.load_model``, numpy's
    ``allow_pickle``; DeepSpeed's checkpoint engine (which unpickles) is replaced."""
    forbidden = re.compile(r"\b(c?pickle\.loads?|cloudpickle|joblib\.load|mlflow\.pytorch"
                           r"|allow_pickle\s*=\s*True|dill\.)")
    sources = [p for d in ("workloads", "orchestrator", "dashboards", "infra")
               for p in (ROOT / d).rglob("*.py")]
    assert len(sources) > 30
    for path in sources:
        text = path.read_text()
        assert not forbidden.search(text), f"{path}: {forbidden.search(text).group(0)}"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                assert any(k.arg == "weights_only" and getattr(k.value, "value", None) is True
                           for k in node.keywords), f"{path}:{node.lineno}: {ast.unparse(node)}"
    engine = (ROOT / "workloads" / "runtime" / "engine.py").read_text()
    assert "checkpoint_engine.load = load_weights_only" in engine
