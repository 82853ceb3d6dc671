"""train.ema_decay: an exponential moving average of the drafter's trainable weights, which OUT/train/final holds
instead of the last step's weights (eval, export and opd read it unchanged).

The average is fp32, one tensor per trainable drafter parameter (the frozen ones are the target's copies and never
move), updated after every optimizer step from the weights every rank holds alike then (DDP: the same update from the
same all-reduced gradients; DeepSpeed ZeRO-1/2: each rank's module weights are the all-gathered full weights after
its step, in bf16 when DeepSpeed trains bf16). So every rank computes the same average; rank 0 saves it in each
checkpoint (ema.pt) and a resumed run loads it, continuing bit for bit.
"""

from __future__ import annotations

import torch


def ema_decay_at(decay: float, step: int) -> float:
    """The decay of the update after 0-based optimizer step `step`: train.ema_decay, capped by (1 + step) / (10 + step)
    early on (0.1 after the first step, 0.5 after the ninth), so the start weights fade within tens of steps instead
    of weighing on the average for ~1 / (1 - decay) of them."""
    return min(decay, (1 + step) / (10 + step))


class WeightAverage:
    """The running average of `draft`'s trainable parameters, named as in its state dict (and its model.safetensors),
    started from their current values."""

    def __init__(self, draft: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = {name: p for name, p in draft.named_parameters() if p.requires_grad}
        self.average = {name: p.detach().float().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after optimizer step `step` (0-based)."""
        decay = ema_decay_at(self.decay, step)
        for name, param in self.params.items():
            self.average[name].mul_(decay).add_(param.detach().float(), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().to("cpu") for name, value in self.average.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], source) -> None:
        """Take a checkpoint's average (`source`: its file, named when it does not match this drafter)."""
        if state.keys() != self.average.keys():
            raise ValueError(f"{source} does not average this recipe's trainable weights: missing "
                             f"{sorted(self.average.keys() - state.keys())}, unexpected "
                             f"{sorted(state.keys() - self.average.keys())}. Delete the checkpoints to train from "
                             f"step 0")
        for name, value in state.items():
            self.average[name].copy_(value)


def averaged_weights(weights: dict[str, torch.Tensor], average: dict[str, torch.Tensor],
                     source) -> dict[str, torch.Tensor]:
    """A draft's state dict with its trainable weights replaced by `average`'s, each in the draft's own dtype."""
    missing = sorted(average.keys() - weights.keys())
    if missing:
        raise ValueError(f"{source} averages weights the draft does not have: {missing}")
    return {name: average[name].to(value.dtype) if name in average else value for name, value in weights.items()}
