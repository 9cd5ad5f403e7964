"""What every DataModule here shares: a root, batch size and workers checked on construction, an
optional generated dataset written by ``prepare_data``, and loaders whose shuffling and worker
seeds depend only on ``(seed, epoch)``, so that a run resumed at an epoch boundary draws exactly
the batches of an uninterrupted one."""

from __future__ import annotations

import inspect
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sized
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, Dataset, RandomSampler


class EpochShuffleSampler(RandomSampler):
    """A random order that depends only on ``(seed, epoch)``, as ``DistributedSampler`` on one process.

    Lightning calls :meth:`set_epoch` at the start of every epoch (and replaces this sampler by a
    ``DistributedSampler`` with the same seed under DDP). The DataLoader draws its base seed, which
    seeds the workers' random augmentation, from the same :attr:`generator` just before the order.

    Args:
        data_source: the dataset to shuffle.
        seed: base seed; Lightning's ``seed_everything`` seed by default (``PL_GLOBAL_SEED``), as
            Lightning's own ``DistributedSampler``.
    """

    generator: torch.Generator

    def __init__(self, data_source: Sized, seed: int | None = None) -> None:
        super().__init__(data_source, generator=torch.Generator())
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Fix the order (and the workers' seeds) of epoch ``epoch``."""
        self.generator.manual_seed(self.seed + epoch)


def check_keywords(function: Callable[..., Any], given: Mapping[str, Any], what: str) -> None:
    """Raise a ValueError naming each key of ``given`` that ``function`` does not take, and the valid ones."""
    parameters = list(inspect.signature(function).parameters)[1:]  # the first is the root folder
    unknown = sorted(set(given) - set(parameters))
    if unknown:
        raise ValueError(f"{what} has unknown key(s) {unknown}; valid keys: {', '.join(parameters)}")


class ImageDataModule(L.LightningDataModule):
    """Base of the DataModules: root, batch size, workers, optional generated data, the loaders.

    Subclasses build their datasets in :meth:`dataset` and name the generator of their format in
    :meth:`synthetic_writer`; a ``collate_fn`` class attribute batches items that do not stack.

    Args:
        root: dataset root folder.
        batch_size: samples per device and step (at least 1).
        num_workers: DataLoader worker processes (0 loads in the main process).
        synthetic: keyword arguments of the format's generator (:mod:`gs_lightning.data.synthetic`);
            when given, :meth:`prepare_data` writes that generated dataset into ``root`` unless it is
            already there.

    Raises:
        ValueError: ``batch_size`` or ``num_workers`` out of range, or an unknown ``synthetic`` key.
    """

    collate_fn: Callable[[list], Any] | None = None
    layout: str = ""
    """The on-disk layout the format expects, as a sentence for error messages ("expected ...")."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch_size: int,
        num_workers: int,
        synthetic: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # The subclass's arguments too (Lightning reads the calling __init__ frames): plain values, so
        # that checkpoints load with torch's weights_only=True.
        self.save_hyperparameters()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size must be a whole number >= 1 (samples per device and step), got {batch_size!r}"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers must be a whole number >= 0 (0 loads in the main process), got {num_workers!r}"
            )
        if synthetic is not None:
            check_keywords(self.synthetic_writer(), synthetic, "synthetic")
        self.root = Path(root).expanduser().absolute()  # errors name the folder wherever the run started
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.synthetic = dict(synthetic) if synthetic is not None else None

    @staticmethod
    def synthetic_writer() -> Callable[..., Path]:
        """The function that writes a generated dataset of this format: ``writer(root, **synthetic)``."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Write the generated dataset into ``root`` when configured and not there yet."""
        if self.synthetic is not None:
            self.synthetic_writer()(self.root, **self.synthetic)

    def dataset(self, split: str) -> Dataset:
        """The dataset of ``split`` (``"train"``, ``"val"`` or ``"test"``), with its transforms."""
        raise NotImplementedError

    def _loader(self, split: str) -> DataLoader:
        dataset = self.dataset(split)
        train = split == "train"
        sampler = EpochShuffleSampler(dataset) if train else None
        return JobDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            generator=sampler.generator if sampler is not None else None,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            worker_init_fn=_worker_init if self.num_workers > 0 else None,
            pin_memory=torch.cuda.is_available(),
            # Training workers start afresh each epoch, seeded from (seed, epoch); evaluation has no randomness.
            persistent_workers=self.num_workers > 0 and not train,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches, in an order fixed by ``(seed, epoch)``."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        """Validation batches in file order."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """Test batches in file order."""
        return self._loader("test")


class JobDataLoader(DataLoader):
    """A ``DataLoader`` whose workers leave a SIGTERM sent to the whole job to the main process.

    SLURM and ``timeout`` send SIGTERM to every process of the job. A worker that died of it would
    end the run with a traceback ("DataLoader worker ... killed by signal") before Lightning, in the
    main process, finishes the batch and saves the run. So workers start with SIGTERM blocked (the
    main process blocks it while it starts them, and they inherit the mask; it unblocks it after,
    when a SIGTERM that came meanwhile reaches it and Lightning); in each worker a thread takes every
    SIGTERM (:func:`_worker_init`): its parent's (``terminate()``, as torch and multiprocessing end a
    worker that outlived its shutdown) ends the worker as before, anyone else's is the parent's to
    act on. Ignoring SIGTERM outright left workers that their parent's exit waited for forever.
    """

    def _get_iterator(self) -> Any:
        if self.num_workers == 0 or not hasattr(signal, "pthread_sigmask"):  # no workers, or not POSIX
            return super()._get_iterator()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _worker_init(worker_id: int) -> None:
    """A DataLoader worker ends on its parent's SIGTERM only (:class:`JobDataLoader`), and is seeded as
    Lightning seeds workers: Lightning adds its own ``worker_init_fn`` only where there is none, so this
    one calls it (``seed_everything(workers=True)``, as the app runs, sets ``PL_SEED_WORKERS``).
    """
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # already, where JobDataLoader started it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, which fork copied
        parent = os.getppid()
        threading.Thread(target=_end_on_sigterm_from, args=(parent,), name="sigterm", daemon=True).start()
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id)


def _end_on_sigterm_from(parent: int) -> None:
    """Take each SIGTERM the worker receives (blocked in all its threads); on ``parent``'s, die of it."""
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # this thread alone: the default action ends it
    os.kill(os.getpid(), signal.SIGTERM)
