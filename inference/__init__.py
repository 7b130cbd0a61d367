"""Inference: the `PoseEstimator` API (inference.estimator) and what it is built of."""
from inference.estimator import Person, PoseEstimator, Prediction

__all__ = ["Person", "PoseEstimator", "Prediction"]
