"""Data: COCO keypoints to HDF5, targets, augmentation, the training dataset, a synthetic set."""
