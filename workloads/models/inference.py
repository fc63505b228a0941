"""A trained ``DecoderLM`` applied to token ids: scoring a text and sampling a continuation.

Both work on any length: a text longer than ``context_length`` is scored in consecutive windows
(each token predicted once, from at most ``context_length`` tokens before it), and generation
conditions on the last ``context_length`` tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workloads.models.decoder import DecoderLM


@torch.no_grad()
def token_nll(model: DecoderLM, ids: list[int]) -> tuple[int, float]:
    """Summed next-token NLL (nats, float64) of ``ids[1:]`` given what precedes each, and the
    number of tokens predicted (``len(ids) - 1``).

    ``ids[0]`` is context only (a document start, e.g. the end-of-text token). Windows of
    ``context_length + 1`` tokens overlap by one, so every token is predicted exactly once, as
    the packed evaluation of training does.

    Raises:
        ValueError: fewer than two ids.
    """
    if len(ids) < 2:
        raise ValueError(f"need at least 2 token ids to score one, got {len(ids)}")
    device = next(model.parameters()).device
    window = model.cfg.context_length
    total = 0.0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window + 1], device=device)
        total += model(chunk[None, :-1], chunk[None, 1:]).sum().double().item()  # (1, T) NLL
    return len(ids) - 1, total


@torch.no_grad()
def generate(model: DecoderLM, ids: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, stop_id: int | None = None) -> list[int]:
    """Sample up to ``max_new_tokens`` ids after the prompt ``ids`` (ancestral sampling).

    ``temperature`` divides the logits (0: greedy, the argmax); ``top_k`` > 0 keeps the k most
    likely tokens; ``seed`` makes the sample reproducible (a ``torch.Generator`` of its own, so
    the global RNG is untouched). Stops early after ``stop_id``, which is not returned.

    Returns the new ids only.

    Raises:
        ValueError: an empty prompt, a negative temperature, top_k or max_new_tokens.
    """
    if not ids:
        raise ValueError("the prompt has no token ids")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise ValueError(f"temperature ({temperature}), top_k ({top_k}) and max_new_tokens "
                         f"({max_new_tokens}) must be >= 0")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    out = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor(out[-model.cfg.context_length:], device=device)
        logits = model(context[None])[0, -1].float()  # (vocab,)
        if temperature == 0:
            token = int(logits.argmax())
        else:
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        if token == stop_id:
            break
        out.append(token)
    return out[len(ids):]
