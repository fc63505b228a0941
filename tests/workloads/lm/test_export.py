"""Hugging Face export of a Llama baseline: ``transformers`` loads the directory, its logits
equal ours, its tokenizer encodes as ours does; CEM models are refused in one line."""

import pytest
import torch
from tokenizers import Tokenizer

from tests.workloads.lm.test_serving import TEXT, tokenizer_json, trained_like  # noqa: F401
from workloads.lm.export import export_hf
from workloads.lm.package import load_decoder, save_package
from workloads.models import ModelConfig

transformers = pytest.importorskip("transformers")  # a dev dependency: always there in CI


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_export_loads_in_transformers_with_our_logits(tmp_path, tokenizer_json, dtype):  # noqa: F811
    cfg = ModelConfig.from_preset("nano", vocab_size=320)
    model = trained_like(cfg).to(dtype)
    save_package(model, tokenizer_json, tmp_path / "package")
    out = export_hf(tmp_path / "package", tmp_path / "hf")
    assert transformers.LlamaForCausalLM.from_pretrained(out).dtype == dtype  # as trained
    # The same weights computing in fp32 on both sides: bf16 arithmetic aside, equal logits.
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(cfg.vocab_size, (2, cfg.context_length))
    with torch.no_grad():
        ours = load_decoder(tmp_path / "package", dtype=torch.float32)(x)
        theirs = hf(x).logits
    assert ours.abs().max() > 1.0  # logits that say something, so that equality does too
    assert (ours - theirs).abs().max().item() < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(TEXT).input_ids == Tokenizer.from_file(str(tokenizer_json)).encode(TEXT).ids
    assert tok.decode(tok(TEXT).input_ids) == TEXT


def test_mlp_naming_is_mapped_not_copied(tmp_path, tokenizer_json):  # noqa: F811
    """Our SiLU is on up_proj, Hugging Face's on gate_proj: copying names would change logits."""
    from safetensors.torch import load_file, save_file

    cfg = ModelConfig.from_preset("nano", vocab_size=320)
    model = trained_like(cfg)
    save_package(model, tokenizer_json, tmp_path / "package")
    out = export_hf(tmp_path / "package", tmp_path / "hf")
    state = load_file(str(out / "model.safetensors"))
    for i in range(cfg.n_layer):
        gate, up = f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"
        assert torch.equal(state[gate], model.blocks[i].mlp.up_proj.weight)
        state[gate], state[up] = state[up], state[gate]  # the naive copy
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    x = torch.randint(cfg.vocab_size, (1, 32))
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max().item() > 1e-2


def test_cem_models_are_refused_in_one_line(tmp_path, tokenizer_json):  # noqa: F811
    cfg = ModelConfig.from_preset("nano", vocab_size=320, attention="cem", mlp="cem")
    save_package(trained_like(cfg), tokenizer_json, tmp_path / "package")
    with pytest.raises(ValueError, match=r"^only Llama baselines .* attention cem, mlp cem: "
                                         r"load it with mlflow.pyfunc.load_model instead$"):
        export_hf(tmp_path / "package", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
