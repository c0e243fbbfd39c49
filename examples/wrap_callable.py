"""Graph a plain callable of tensors with ``graphrt.wrap``: no ForwardBatch, no model changes.

    python examples/wrap_callable.py          # emulated graphs on CPU, CUDA graphs on a GPU
"""

from __future__ import annotations

import random

import torch

from graphrt import wrap


def main() -> None:
    """Call a wrapped MLP at random batch sizes, check it against eager, print the counters."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 32)
    ).to(device)

    def head(hidden: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return torch.softmax(mlp(hidden) / temperature, dim=-1) * mask

    fast = wrap(head, max_batch_size=32, capture_sizes=[1, 2, 4, 8, 16, 32])
    rng = random.Random(0)
    worst = 0.0
    with torch.no_grad():
        for _ in range(50):
            batch_size = rng.randint(1, 40)  # sizes above 32 run eagerly (batch_too_large)
            hidden = torch.randn(batch_size, 64, device=device)
            mask = torch.ones(batch_size, 1, device=device)
            out = fast(hidden, mask=mask, temperature=0.7)
            worst = max(worst, float((out - head(hidden, mask, 0.7)).abs().max()))
    stats = fast.stats()
    print(f"backend {stats['backend']}: {stats['graph_runs']} graph runs, {stats['eager_runs']} eager "
          f"{stats['eager_reasons']}, padding waste {stats['padding_waste']:.1%}, max |graph - eager| {worst:.2e}")
    if worst > 1e-5:
        raise SystemExit("graph and eager results disagree")


if __name__ == "__main__":
    main()
