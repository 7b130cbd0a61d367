"""One preprocessing for training and inference (data.preprocess): the same picture gives the same
network input on both paths, grey outside the picture on both."""
from __future__ import annotations

import numpy as np
import torch

from data.skeleton import builtin
from config.views import PredictSettings, SampleSettings
from data.augment import warp_image
from data.dataset import KeypointDataset
from data.preprocess import GREY, bgr_to_input, normalise, pictures_to_batch
from inference.estimator import PoseEstimator

COCO = builtin("coco")


def test_training_warp_and_inference_padding_give_the_same_tensor():
    picture = np.random.default_rng(0).integers(0, 256, (90, 100, 3), dtype=np.uint8)
    identity = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    trained_on = bgr_to_input(torch.from_numpy(warp_image(picture, identity, 128)))    # data.transfer's path
    inferred_on = pictures_to_batch([picture], (128, 128), torch.device("cpu"))[0]     # inference's path
    assert trained_on.shape == inferred_on.shape == (3, 128, 128)
    assert torch.equal(trained_on, inferred_on)
    grey = normalise(torch.tensor(GREY[::-1], dtype=torch.uint8))
    assert torch.equal(inferred_on[:, 100:, 100:], grey[:, None, None].expand(3, 28, 28))
    assert torch.equal(inferred_on[:, :90, :100], normalise(torch.from_numpy(picture[:, :, ::-1].copy()))
                       .permute(2, 0, 1))


def test_normalisation_is_one_function_with_the_values_the_network_sees():
    values = normalise(torch.tensor([0, 128, 255], dtype=torch.uint8))
    assert torch.equal(values, torch.tensor([0.0, 128.0, 255.0]) / 255)     # the authors': no offset
    exact = normalise(torch.tensor([0, 128, 255], dtype=torch.uint8), torch.float64)
    assert exact.dtype == torch.float64
    assert torch.equal(exact, torch.tensor([0.0, 128.0, 255.0], dtype=torch.float64) / 255)


def test_dataset_samples_and_predict_use_the_module(synthetic_h5, monkeypatch):
    from config.loader import build_config
    from models import build_model

    cfg = build_config("tiny", sets=["inference.scales=[1.0]"])
    dataset = KeypointDataset(synthetic_h5[1], SampleSettings.of(cfg), train=False)
    image = dataset[0][0]
    assert torch.equal(image, bgr_to_input(torch.from_numpy(dataset.sample_arrays(0)["image"])))
    seen = []
    model = build_model(cfg.model, COCO).eval()
    model.stem.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    picture = np.full((100, 70, 3), 7, np.uint8)
    PoseEstimator(model, PredictSettings.of(cfg)).maps([picture])
    # resized to height 128, width 90 -> padded to 128 x 128: grey to the right, the picture's 7 left
    assert torch.equal(seen[0][0, :, :, 100:], normalise(torch.full((3, 128, 28), 128, dtype=torch.uint8)))
    assert torch.equal(seen[0][0, :, :, :80], normalise(torch.full((3, 128, 80), 7, dtype=torch.uint8)))


def test_the_cpu_input_has_the_values_of_the_device_conversion():
    """`bgr_to_input` on the CPU (numpy, float32) gives the values of the torch conversion any other
    device runs: the channels reversed, then `normalise`; one picture and a batch."""
    batch = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8))
    batch[0, 0, 0] = torch.tensor([0, 128, 255], dtype=torch.uint8)
    for pictures in (batch, batch[1]):
        expected = normalise(pictures.movedim(-1, -3).flip(-3).contiguous())
        got = bgr_to_input(pictures)
        assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, expected)
    assert torch.equal(bgr_to_input(batch)[0, :, 0, 0], torch.tensor([255.0, 128.0, 0.0]) / 255)
    half = bgr_to_input(batch, torch.float16)
    assert torch.equal(half, normalise(batch.movedim(-1, -3).flip(-3).contiguous(), torch.float16))


def test_a_deeper_network_runs_on_pictures_padded_to_the_sizes_it_takes():
    """model.depth 5 takes multiples of 128 (config.loader.input_multiple); a picture padded to 64 x
    192 pixels alone would break its hourglass."""
    from config.loader import build_config
    from models import build_model

    cfg = build_config("tiny", sets=["model.depth=5", "loss.scale_weights=[1,1,1,1,1,1]",
                                     "inference.scales=[1.0]"])
    model = build_model(cfg.model, COCO).eval()
    (maps,) = PoseEstimator(model, PredictSettings.of(cfg)).maps([np.full((128, 160, 3), 7, np.uint8)])
    assert maps.shape == (COCO.num_channels, 128, 160)
