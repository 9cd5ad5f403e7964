"""FSDP2 for the tasks: under Lightning's ``ModelParallelStrategy`` a task's ``configure_model`` shards its network.

Every task holds its network as ``self.model`` and subclasses :class:`ShardedTask`. Under
``ModelParallelStrategy`` (``trainer=model_parallel``) ``configure_model`` applies
``torch.distributed.fsdp.fully_shard`` to each block of the network (:func:`shard_units`), then to the
network itself, over the ``data_parallel`` dimension of the strategy's device mesh. Parameters stay
float32 (no ``MixedPrecisionPolicy``): autocast computes in fp16 as under DDP, and the gradient
scaling plugins refuse fp16 parameters. Parameter names do not change (FSDP2 adds no wrapper), so a
consolidated checkpoint loads into an unsharded task and back. Under every other strategy
``configure_model`` does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardedTask", "shard_model", "shard_units"]


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard_units(model: nn.Module) -> Iterator[nn.Module]:
    """The blocks of ``model`` that :func:`shard_model` makes FSDP2 units of their own.

    These are the children that hold parameters (ResNet's residual stages, SSD's backbone and head),
    with a ``ModuleList`` or ``ModuleDict`` replaced by its members (SegNet's encoder and decoder
    stages): a container that is never called gives FSDP2 no forward to gather its parameters in.
    A child that holds parameters of its own (a lone convolution, BatchNorm or linear layer such as
    ResNet's stem and ``fc``) stays in the unit of ``model``, gathered with it.
    """
    for child in model.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            yield from filter(_holds_parameters, child.children())
        elif _holds_parameters(child) and next(child.parameters(recurse=False), None) is None:
            yield child


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` each of :func:`shard_units`, then ``model`` (the unit of what is left), over ``mesh``.

    ``model`` must be the module the task calls: FSDP2 gathers the root unit's parameters in its
    forward. Parameters keep their dtype (float32).
    """
    # Imported here: the tasks import on torch builds without torch.distributed too.
    from torch.distributed.fsdp import fully_shard

    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


class ShardedTask(L.LightningModule):
    """A LightningModule whose network ``self.model`` is sharded with FSDP2 under ``ModelParallelStrategy``.

    The strategy's device mesh must be all data parallel (``tensor_parallel_size=1``): the tasks
    apply no tensor parallelism, and ranks of a tensor-parallel group would read the same batches.
    """

    model: nn.Module

    def configure_model(self) -> None:
        """Shard ``self.model`` under ``ModelParallelStrategy``; a no-op under any other strategy
        and when already sharded (Lightning calls this hook again for ``trainer.test`` after ``fit``).

        Raises:
            ValueError: the strategy's device mesh has a tensor-parallel dimension larger than 1.
        """
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"{type(self).__name__} shards its model over data-parallel ranks only, but the device mesh is "
                f"data_parallel={mesh['data_parallel'].size()} x tensor_parallel={mesh['tensor_parallel'].size()}; "
                "set trainer.strategy.data_parallel_size=<devices x nodes> and trainer.strategy.tensor_parallel_size=1"
            )
        shard_model(self.model, mesh["data_parallel"])
