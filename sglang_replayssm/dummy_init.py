"""Random weights at trained-model scale, for greedy-parity tests with dummy models.

SGLang's ``--load-format dummy`` fills every parameter with uniform(-1e-3,
1e-3) (``model_loader/weight_utils.py`` ``initialize_dummy_weights``). At that
scale an SSM layer's contribution to the residual stream is far below what
the logits can resolve: every served logprob comes out as -ln(vocab) and the
greedy token depends on the last input token only, so comparing ReplaySSM's
greedy output with stock SGLang's tests nothing about the SSM. This init
makes the SSM matter:

* 2-D+ weights (projections, embeddings, lm head, conv filters): normal(0, 0.02);
* Mamba-2 ``A`` (SGLang stores -exp(A_log)): -uniform(1, 16); GDN ``A_log``:
  log uniform(1, 16);
* ``dt_bias``: softplus^-1 of a log-uniform step in [1e-3, 1e-1] (Mamba's init);
* ``D``: 1; other 1-D parameters: 1 for norm weights, 0 otherwise (biases).

``echo`` (SGLANG_REPLAYSSM_DUMMY_INIT=echo) is the same init with the token
embedding scaled by ``ECHO_EMBEDDING_SCALE`` and copied into the LM head: the
residual stream is then dominated by the input token's embedding, so the
logits ``E . norm(e_t + layers)`` peak at t and the greedy output repeats the
last prompt token. Every layer still runs on every token. It exists for
serving speculative decoding with drafts accepted (NGRAM finds the
repetition): with random weights no draft is ever accepted, and a verify
that rolls back every draft measures only the overhead. Its outputs say
nothing about parity.

Deterministic like SGLang's: one generator per parameter seeded with
``seed`` (+ a stable hash of the name), so stock and ReplaySSM servers of
the same model get the same weights. Selected with the environment variable
``SGLANG_REPLAYSSM_DUMMY_INIT=scaled`` or ``echo`` (a test knob, see
:func:`sglang_replayssm.sglang_hooks.install_dummy_init_hook`).
"""
from __future__ import annotations

import math
import zlib

import torch

__all__ = ["scaled_dummy_weights", "echo_dummy_weights", "echo_parameters", "DUMMY_INITS"]

WEIGHT_STD = 0.02
# |e_t| = 0.02 * 20 * sqrt(d): a 2048-wide model's embedding has norm ~18,
# several times what the (pre-normed) layers add at WEIGHT_STD, and the echo
# holds while the layers add less than ~(sqrt(d) / 7) |e_t| in a random
# direction (argmax over the vocabulary of e_s . (e_t + delta))
ECHO_EMBEDDING_SCALE = 20.0


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _fill(name: str, t: torch.Tensor, g: torch.Generator) -> None:
    leaf = _leaf(name)
    f32 = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    if leaf == "A":
        f32.uniform_(1.0, 16.0, generator=g).neg_()
    elif leaf == "A_log":
        f32.uniform_(1.0, 16.0, generator=g).log_()
    elif leaf == "dt_bias":
        dt = torch.exp(f32.uniform_(math.log(1e-3), math.log(1e-1), generator=g))
        f32 = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    elif leaf == "D":
        f32.fill_(1.0)
    elif t.dim() >= 2:
        f32.normal_(0.0, WEIGHT_STD, generator=g)
    elif "norm" in name and leaf == "weight":
        f32.fill_(1.0)
    else:
        f32.zero_()
    t.copy_(f32.to(t.dtype))


@torch.no_grad()
def scaled_dummy_weights(model: torch.nn.Module, seed: int = 1234) -> None:
    """Fill ``model``'s floating-point state in place (see the module doc)."""
    for name, t in model.state_dict().items():
        if not torch.is_floating_point(t) or torch.finfo(t.dtype).bits < 16:
            continue  # ints / fp8 storage: leave SGLang's values
        g = torch.Generator(device=t.device)
        g.manual_seed(seed + zlib.crc32(name.encode()))
        _fill(name, t, g)


def echo_parameters(model: torch.nn.Module) -> tuple[str, str | None]:
    """(token embedding, LM head) parameter names :func:`echo_dummy_weights`
    ties; the head is None where the model already ties them (one parameter).
    The embedding: the one 2-D ``*embed*.weight`` shaped like the head."""
    params = dict(model.named_parameters())
    heads = [n for n in params if n.endswith("lm_head.weight")]
    if len(heads) > 1:
        raise ValueError(f"echo dummy init: several LM heads {heads}")
    embeddings = [n for n, t in params.items() if "embed" in _leaf(n.rsplit(".", 1)[0])
                  and n.endswith(".weight") and t.dim() == 2
                  and (not heads or t.shape == params[heads[0]].shape)]
    if len(embeddings) != 1:
        raise ValueError(f"echo dummy init needs one token embedding (a 2-D '*embed*.weight' "
                         f"shaped like the LM head), found {embeddings} in "
                         f"{type(model).__name__}")
    return embeddings[0], (heads[0] if heads else None)


@torch.no_grad()
def echo_dummy_weights(model: torch.nn.Module, seed: int = 1234) -> None:
    """:func:`scaled_dummy_weights`, then the token embedding scaled by
    ``ECHO_EMBEDDING_SCALE`` and copied into the LM head (see the module doc).
    A model with tied embeddings keeps them tied."""
    embedding_name, head_name = echo_parameters(model)
    scaled_dummy_weights(model, seed=seed)
    params = dict(model.named_parameters())
    embedding = params[embedding_name]
    embedding.mul_(ECHO_EMBEDDING_SCALE)
    if head_name is not None and params[head_name].data_ptr() != embedding.data_ptr():
        params[head_name].copy_(embedding)


DUMMY_INITS = {"scaled": scaled_dummy_weights, "echo": echo_dummy_weights}
