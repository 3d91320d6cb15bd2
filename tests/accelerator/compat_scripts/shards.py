"""Which samples each process receives, and in what order, for the data loader options a
script can choose: shuffled or not (with the global seed, a generator of the loader's own, or
the seedable sampler), batches that do not divide the dataset, drop_last, even_batches,
split_batches; two epochs each; and what gather_for_metrics returns from them."""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

# (samples, batch size, shuffle, drop_last, even_batches, split_batches, seedable, generator)
CASES = [
    (23, 3, False, False, True, False, False, False),
    (23, 3, True, False, True, False, False, False),
    (24, 3, True, False, True, False, False, True),
    (20, 3, True, False, True, False, False, False),
    (4, 3, True, False, True, False, False, False),   # less than one round
    (23, 3, True, True, True, False, False, False),   # drop_last
    (23, 3, True, False, False, False, False, False),  # even_batches=False
    (20, 4, True, False, True, True, False, False),   # split_batches
    (21, 4, False, False, False, True, False, False),  # split, uneven, not even
    (23, 3, True, False, True, False, True, False),   # seedable sampler
]
CONFIG = {"seed": 5, "cases": CASES, "epochs": 2}


def training_function(config, args):
    results = []
    for n, bs, shuffle, drop_last, even, split, seedable, own in config["cases"]:
        accelerator = Accelerator(cpu=args.cpu, dataloader_config=DataLoaderConfiguration(
            even_batches=even, split_batches=split, use_seedable_sampler=seedable))
        set_seed(config["seed"])
        generator = torch.Generator().manual_seed(99) if own else None
        dataloader = DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, shuffle=shuffle,
                                drop_last=drop_last, generator=generator)
        dataloader = accelerator.prepare(dataloader)
        record = {"len": len(dataloader), "total": dataloader.total_batch_size, "epochs": []}
        for epoch in range(config["epochs"]):
            seen, gathered = [], []
            for (index,) in dataloader:
                seen.append(index.tolist())
                if even or accelerator.num_processes == 1:  # uneven ranks would not meet
                    gathered.append(accelerator.gather_for_metrics(index).tolist())
            # a draw after each epoch: the global generator must be where Accelerate left it
            record["epochs"].append({"seen": seen, "gathered": gathered,
                                     "after": torch.randint(0, 10**6, (1,)).item()})
        results.append(record)
    return results


def main():
    parser = argparse.ArgumentParser(description="Data shards per process.")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU only")
    args = parser.parse_args()
    for record in training_function(dict(CONFIG), args):
        print(record["epochs"][0]["seen"])


if __name__ == "__main__":
    main()
