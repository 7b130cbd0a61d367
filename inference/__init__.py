"""Inference: network maps of an image, grouping into people, COCO keypoint AP, evaluation."""
