"""The per-example reference every clipping mode is checked against (tests/privacy/): each
example's gradient of its own loss by torch.func (functional_call + vmap(grad) over the
examples: a batch-size-1 backward per example, none of bk's or Opacus' code), clipped with
Opacus' factor Cᵢ = min(1, C / (‖∇ℓᵢ‖ + 1e-6)) and summed; and each mode's clipped sum as the
teacher stage forms it (BookKeepingPrivacyEngine.make_private, dpsgd.CLIPPING, σ = 0)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.models.losses import per_sequence_loss

TEXTS = [  # four lengths: a padded batch
    "Great tacos and friendly staff.",
    "Never again.",
    "The room was clean but the bed was hard, and the breakfast was cold.",
    "Ok",
]


def batch(tokenizer) -> tuple[dict, torch.Tensor]:
    """The teacher stage's inputs for TEXTS (input_ids, attention_mask, position_ids) and labels."""
    ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in TEXTS]
    data = TokenizedRecords(ids, tokenizer.pad_token_id, 24)
    assert len(set(data.lengths.tolist())) == len(TEXTS)
    inputs = lm_batch(data.ids, data.lengths)
    return inputs, inputs.pop("labels")


def per_example_grads(model: nn.Module, loss_fn, *inputs) -> dict[str, torch.Tensor]:
    """{name: (B, *shape)}: each example's gradient of its own loss, by torch.func on a copy.
    `loss_fn(model_call, *one_example)` gets each input without its batch dimension."""
    ref = copy.deepcopy(model)
    params = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    buffers = dict(ref.named_buffers())

    def loss_of(p, *one):
        return loss_fn(lambda **kw: functional_call(ref, (p, buffers), args=(), kwargs=kw), *one)

    return vmap(grad(loss_of), in_dims=(None,) + (0,) * len(inputs))(params, *inputs)


def clipped_sum(grads: dict[str, torch.Tensor], max_grad_norm: float):
    """Opacus' clipping of per-example gradients {name: (B, ...)}: (clipped sums, factors, norms)."""
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()  # (B,)
    coef = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", coef, g) for n, g in grads.items()}, coef, norms


def assert_clipped_sums_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


def lm_loss(call, ids, mask, positions, labels):
    logits = call(input_ids=ids[None], attention_mask=mask[None], position_ids=positions[None]).logits
    return per_sequence_loss(logits, labels[None])[0]


def reference(model: nn.Module, inputs: dict, labels: torch.Tensor, max_grad_norm: float | None = None):
    """(clipped sums, C): the reference's clipped sum at `max_grad_norm`, by default the median
    example's norm (some examples clipped, some not)."""
    grads = per_example_grads(model, lm_loss, inputs["input_ids"], inputs["attention_mask"],
                              inputs["position_ids"], labels)
    if max_grad_norm is None:
        max_grad_norm = clipped_sum(grads, 1.0)[2].median().item()
    return clipped_sum(grads, max_grad_norm)[0], max_grad_norm


def mode_clipped_sum(model: nn.Module, mode: str, inputs: dict, labels: torch.Tensor,
                     max_grad_norm: float) -> dict[str, torch.Tensor]:
    """Σᵢ Cᵢ ∇ℓᵢ as `mode` forms it in the teacher stage, on a copy of `model`: wrapped by
    make_private, one CLIPPING backward, the optimizer's pre-step at σ = 0 (which divides by
    the expected batch, undone here)."""
    from pipeline.privacy.bk import BookKeepingPrivacyEngine
    from pipeline.privacy.dpsgd import CLIPPING

    model = copy.deepcopy(model).train()
    size = labels.shape[0]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(size, 1)), batch_size=size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = BookKeepingPrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
            data_loader=loader, noise_multiplier=0.0, max_grad_norm=max_grad_norm, poisson_sampling=False,
            grad_sample_mode=mode)
    dp_model, optimizer = made[0], made[1]
    CLIPPING[mode](dp_model, optimizer, per_sequence_loss(dp_model(**inputs).logits, labels))
    optimizer.pre_step()
    return {n: p.grad * size for n, p in model.named_parameters() if p.requires_grad}
