"""Networks of the experiments."""

from gs_lightning.models.multibox import MultiboxLoss
from gs_lightning.models.resnet import build_resnet
from gs_lightning.models.segnet import SegNetBasic
from gs_lightning.models.ssd import SSDVGG16, build_ssd

__all__ = ["MultiboxLoss", "SSDVGG16", "SegNetBasic", "build_resnet", "build_ssd"]
