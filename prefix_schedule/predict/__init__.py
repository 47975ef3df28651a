"""Predicted step time and memory of dense vs prefix reuse for a model, a layout and a device:
devices.py (GPU specs as data, measured devices), roofline.py (seconds per op), step.py (per
action, through the lowered schedule's dry run). No Megatron import (docs/PREDICT.md)."""
from prefix_schedule.predict.devices import GPUS, DeviceSpec, get_device, load_device
from prefix_schedule.predict.roofline import Cost, Layout
from prefix_schedule.predict.step import PathPrediction, StepPrediction, predict_step

__all__ = ["Cost", "DeviceSpec", "GPUS", "Layout", "PathPrediction", "StepPrediction",
           "get_device", "load_device", "predict_step"]
