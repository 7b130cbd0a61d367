"""Inference: the `PoseEstimator` API (inference.estimator) and what it is built of, imported when
first named (a command's --help needs no torch)."""
__all__ = ["Person", "PoseEstimator", "Prediction"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'inference' has no attribute {name!r}")
    from inference import estimator
    return getattr(estimator, name)
