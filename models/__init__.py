"""The network (IMHN) and its multi-task focal L2 loss; `models.summary` counts parameters and MACs."""
from models.imhn import IMHN, build_model
from models.loss import FocalL2Loss

__all__ = ["IMHN", "FocalL2Loss", "build_model"]
