"""``accelerate.data_loader``'s names: `prepare_data_loader` (a data loader sharded over the
processes without an `Accelerator`), `skip_first_batches` and `SeedableRandomSampler`
(`meshfit.accelerator.standalone`)."""

from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.accelerator.shuffle import SeedableRandomSampler
from meshfit.accelerator.standalone import prepare_data_loader, skip_first_batches

# Accelerate's class names for what `prepare_data_loader` returns.
DataLoaderShard = DataLoaderDispatcher = PreparedDataLoader

__all__ = ["DataLoaderDispatcher", "DataLoaderShard", "PreparedDataLoader",
           "SeedableRandomSampler", "prepare_data_loader", "skip_first_batches"]
