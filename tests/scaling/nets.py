"""Tiny networks with the graph shapes the scaler must handle (branches, splits, ties, unpooling, checkpointing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


class SSDLike(nn.Module):
    """A backbone with prediction heads branching off several of its feature maps."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.stage2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.stage3 = nn.Sequential(nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU())
        self.loc = nn.ModuleList(nn.Conv2d(c, 4 * 2, 3, padding=1) for c in (8, 16, 16))
        self.conf = nn.ModuleList(nn.Conv2d(c, num_classes * 2, 3, padding=1) for c in (8, 16, 16))
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f1 = self.stage1(x)
        f2 = self.stage2(f1)
        f3 = self.stage3(f2)
        locs, confs = [], []
        for f, loc, conf in zip((f1, f2, f3), self.loc, self.conf):
            locs.append(loc(f).permute(0, 2, 3, 1).flatten(1))
            confs.append(conf(f).permute(0, 2, 3, 1).reshape(x.shape[0], -1, self.num_classes))
        return torch.cat(locs, 1).pow(2).mean() + F.cross_entropy(
            torch.cat(confs, 1).flatten(0, 1),
            torch.zeros(confs[0].shape[0] * sum(c.shape[1] for c in confs), dtype=torch.long),
        )


class SegNetLike(nn.Module):
    """Encoder-decoder with max-pooling indices reused for unpooling, as SegNet."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.dec2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.dec1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.classifier = nn.Conv2d(8, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1, i1 = F.max_pool2d(self.enc1(x), 2, return_indices=True)
        e2, i2 = F.max_pool2d(self.enc2(e1), 2, return_indices=True)
        d2 = self.dec2(F.max_unpool2d(e2, i2, 2, output_size=e1.shape[-2:]))
        d1 = self.dec1(F.max_unpool2d(d2, i1, 2, output_size=x.shape[-2:]))
        return self.classifier(d1)


class DenseBlock(nn.Module):
    """DenseNet-like: every layer sees the concatenation of all earlier feature maps."""

    def __init__(self, channels: int = 4, growth: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.BatchNorm2d(channels + k * growth), nn.ReLU(), nn.Conv2d(channels + k * growth, growth, 3, padding=1)
            )
            for k in range(layers)
        )
        self.head = nn.Linear(channels + layers * growth, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return self.head(torch.cat(features, 1).mean((2, 3)))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight, used in two GEMMs."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens)))
        h = h + self.mix(h) @ self.out.weight.T @ self.out.weight  # a second use of the tied weight, by matmul
        return self.out(h)


class SplitNet(nn.Module):
    """split, chunk and unbind with parts taking different paths and different scales."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 12)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(3, 3)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        p, q, r = torch.split(h, [4, 4, 4], dim=1)
        u, v = torch.chunk(r, 2, dim=1)
        rows = torch.unbind(h.reshape(-1, 4, 3), dim=1)
        return self.head(torch.cat([self.a(p), self.b(q) * 1e-3, u * v, self.c(rows[0] + rows[2])[:, :2]], 1))


class _ScaleAndShift(torch.autograd.Function):
    """A custom Function with two outputs, each flowing into its own path."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2.0, x - 1.0

    @staticmethod
    def backward(ctx, g_scaled: torch.Tensor, g_shifted: torch.Tensor) -> torch.Tensor:
        return g_scaled * 2.0 + g_shifted


class TwoOutputNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.left = nn.Linear(6, 6)
        self.right = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _ScaleAndShift.apply(self.inp(x))
        return self.out(self.left(torch.relu(a)) + 0.01 * self.right(torch.relu(b)))


class PlainCNN(nn.Module):
    """Deep plain CNN (no residuals, no BN): its gradients underflow in fp16 without scaling."""

    def __init__(self, width: int = 16, depth: int = 6, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


class CheckpointedNet(nn.Module):
    """Activation checkpointing as users write it: checkpointed blocks inside residual branches,
    a checkpoint nested in a checkpoint, and ``checkpoint_sequential``."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.ModuleDict({"a": nn.Linear(16, 16), "b": nn.Linear(16, 16)}) for _ in range(2))
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.tail = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def _block(self, block: nn.ModuleDict, h: torch.Tensor) -> torch.Tensor:
        h = block["a"](h).relu()
        h = checkpoint(self.inner, h, use_reentrant=self.use_reentrant)  # nested
        return block["b"](h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + checkpoint(self._block, block, h, use_reentrant=self.use_reentrant)  # in a residual branch
        h = checkpoint_sequential(self.tail, 2, h, use_reentrant=self.use_reentrant)
        return self.head(h)


class CheckpointSharedNet(nn.Module):
    """One layer used outside and inside a reentrant checkpoint: its ``.grad`` gets contributions
    from the outer backward and from the checkpoint's inner one."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(x).relu()
        h = h + checkpoint(lambda t: self.shared(t).relu(), h, use_reentrant=True)
        return self.head(h)
