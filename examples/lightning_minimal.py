"""A PyTorch Lightning program on Horovod: the digits CNN, trained by a Lightning Trainer with
hvdtrain's strategy="horovod".

Launch::

    horovodrun -np 2 python examples/lightning_minimal.py [result.json]
"""
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hvdtrain.torch.lightning  # noqa: F401  (registers strategy="horovod")
from hvdtrain import datasets
from hvdtrain.torch.models import DigitsCNN


class Digits(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = DigitsCNN()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.model(x).argmax(1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)     # averaged over the ranks

    def configure_optimizers(self):
        # The global batch's rate (Goyal et al. 2017's linear rule), set by hand as under DDP.
        lr = 0.01 * self.trainer.world_size * self.trainer.accumulate_grad_batches
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)


L.seed_everything(0)
split = datasets.load_digits()
train = TensorDataset(torch.from_numpy(split.x_train), torch.from_numpy(split.y_train))
test = TensorDataset(torch.from_numpy(split.x_test), torch.from_numpy(split.y_test))
trainer = L.Trainer(strategy="horovod", accelerator="cpu", devices=1, max_epochs=10,
                    accumulate_grad_batches=2,                 # one all-reduce per 2 batches
                    logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Digits(), DataLoader(train, batch_size=16, shuffle=True),   # a DistributedSampler
            DataLoader(test, batch_size=64))                             # is put in for each

accuracy = trainer.callback_metrics["val_accuracy"].item()
if trainer.is_global_zero:
    print(f"held-out accuracy {accuracy:.4f} on {trainer.world_size} ranks")
    import json, sys                                           # optional: results as a file
    if len(sys.argv) > 1:                                      # (tests read them from there)
        with open(sys.argv[1], "w") as f:
            json.dump({"accuracy": accuracy, "size": trainer.world_size}, f)
