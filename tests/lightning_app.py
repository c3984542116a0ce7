"""The Lightning main job with test-only variants (manual optimization); run as a script.

Lightning's launcher re-executes this script for rank 1, so tests run it in a subprocess.
"""

import torch

from examples.models import ModelConfig
from examples.train_lightning import LitDecoder, hf_decoder, parser, run


class ManualDecoder(LitDecoder):
    """The same model trained with manual optimization."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = self.model.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss


def main() -> None:
    p = parser()
    p.add_argument("--manual", action="store_true")
    args = p.parse_args()
    if args.manual:
        torch.manual_seed(0)
        config = ModelConfig(dropout=args.dropout, hidden_size=128, intermediate_size=256)
        run(args, ManualDecoder(config))
    else:
        run(args, *(hf_decoder(args) if args.hf else ()))


if __name__ == "__main__":
    main()
