"""The model file the command-line examples of docs/inspection.md name: a small MLP."""

from torch import nn


def build_model(width: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))
