"""Networks of the experiments."""

from gs_lightning.models.resnet import build_resnet
from gs_lightning.models.segnet import SegNetBasic

__all__ = ["SegNetBasic", "build_resnet"]
from gs_lightning.models.multibox import MultiboxLoss  # noqa: E402
from gs_lightning.models.ssd import SSDVGG16, build_ssd  # noqa: E402

__all__ += ["MultiboxLoss", "SSDVGG16", "build_ssd"]
