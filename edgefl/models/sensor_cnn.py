"""A 1-D CNN for inertial-sensor windows (channels x samples), e.g. HAPT's 6 x 128."""

import torch
from torch import nn


class SensorCNN(nn.Module):
    """conv1d-relu-pool x2 -> global average -> linear."""

    def __init__(
        self, in_channels: int, num_classes: int, width: int = 32, kernel: int = 5
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(in_channels, width, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(width, 2 * width, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(2 * width, 2 * width, kernel, padding=kernel // 2),
            nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(2 * width, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, channels, length) -> (batch, num_classes) logits."""
        return self.head(self.features(x))  # type: ignore[no-any-return]
