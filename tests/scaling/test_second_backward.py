"""The PyTorch AMP recipe's gradient penalty on a small BERT: a second backward through the first one's graph.

Under ``create_graph=True`` the first backward's graph holds the scaler's own ×2^β factors and nodes
such as ``GeluBackwardBackward0`` that multiply by a saved first-order gradient: gains no decision
sees unless the update counts them, as it counts a batch norm's. GradScaler skips no step here; GS
skipped every one before it did.
"""

from __future__ import annotations

import torch
import transformers

from gs_lightning import GradientScaler

STEPS = 4


def _penalty_run(make_scaler) -> list[bool]:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler, params = make_scaler(model), list(model.parameters())
    generator, stepped = torch.Generator().manual_seed(0), []
    for _ in range(STEPS):
        x, y = torch.randint(1, 100, (8, 16), generator=generator), torch.randint(0, 2, (8,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=x, labels=y).loss
        grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True, allow_unused=True)
        inv_scale = 1.0 / scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss + sum((g * inv_scale).pow(2).sum() for g in grads if g is not None).sqrt()
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in params]
        scaler.step(optimizer)
        scaler.update()
        stepped.append(any(not torch.equal(a, p) for a, p in zip(before, params)))
    return stepped


def test_a_gradient_penalty_skips_no_step_where_gradscaler_skips_none() -> None:
    assert _penalty_run(lambda model: torch.amp.GradScaler("cpu")) == [True] * STEPS
    assert _penalty_run(GradientScaler) == [True] * STEPS
