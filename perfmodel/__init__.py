"""Operator performance models: the time of one operator on a target GPU at a target size."""

from perfmodel.base import MODELS, OperatorModel, Target, model_class, op_features, register
from perfmodel.calibrated import CalibratedModel, Calibration
from perfmodel.learned import LearnedModel
from perfmodel.regression import LinearRegressionModel
from perfmodel.replay import TraceTime
from perfmodel.roofline import Roofline


def make_model(kind: str, trace, **options) -> OperatorModel:
    """Build a registered model by name ("trace", "regression", "roofline", "calibrated")."""
    return model_class(kind)(trace, **options)


__all__ = [
    "MODELS",
    "CalibratedModel",
    "Calibration",
    "LearnedModel",
    "LinearRegressionModel",
    "OperatorModel",
    "Roofline",
    "Target",
    "TraceTime",
    "make_model",
    "model_class",
    "op_features",
    "register",
]
