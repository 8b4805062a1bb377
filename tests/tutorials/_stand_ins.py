"""What the ColossalAI tutorials import that elixir does not ship, sized for tests: a tiny GPT-2
config, ``ColoInitContext`` (ColossalAI's init context, long removed there: ``torch.device``'s
context manager does what the tutorial asks of it), and a tiny ResNet in place of torchvision's.
The tutorial programs change only their imports to use these."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import transformers

GPT2Config = functools.partial(transformers.GPT2Config, n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=128)
ColoInitContext = torch.device


class _TinyResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, stride=4, padding=3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.fc(x.mean((2, 3)))


def resnet18() -> nn.Module:
    return _TinyResNet()
