"""Find the people in a picture, a folder of pictures, a video or a camera's stream, and draw them.

    python demo.py --weights best.pth --image photo.jpg --out photo_pose.png [--heatmaps]
        [--scales 0.5 1 1.5 2 3] [--flip]
    python demo.py --weights best.pth --image photos/ [--out photos_pose/]
    python demo.py --weights best.pth --video clip.mp4 [--out clip_pose.mp4]
    python demo.py --weights best.pth --camera 0          # live window; q or Esc ends it
    python demo.py --weights pose.onnx --image photo.jpg  # a network exported by export.py

Each person is drawn in its own colour; a folder's NAME.EXT is written as OUT/NAME_pose.png; a video
keeps its frame rate; videos and the camera end with the frames/s achieved.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import time
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from common.errors import ArgumentParser, DataError, refuse_inapplicable
from common.paths import refuse_clashes, refuse_existing
from data.picture_files import check_picture_path, read_picture, write_image
from inference.command_line import CONFIG_CARRIED, command_main, weights_options
from inference.draw import draw_people, maps_panel
from inference.video import check_video_out, frame_rate, frames, open_camera, open_video, video_out

PICTURE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def build_parser() -> ArgumentParser:
    p = weights_options(__doc__, "checkpoint, bare state dict, or ONNX file written by export.py",
                        preset_help=f" (default: imhn512); {CONFIG_CARRIED}")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", help="picture to read (any format OpenCV reads), or a folder of pictures")
    source.add_argument("--video", help="video file to read (any format OpenCV reads)")
    source.add_argument("--camera", type=int, metavar="N", help="camera number: a live window")
    p.add_argument("--out", help="picture, folder or video (.mp4, .avi) to write (default, next to the "
                   "input: IMAGE_pose.png, FOLDER_pose, VIDEO_pose.mp4)")
    p.add_argument("--heatmaps", action="store_true", help="add a panel of the summed maps")
    return p


def pictures_to_draw(image: str, out: str | None) -> list[tuple[Path, Path]]:
    """(picture to read, picture to write) pairs for `--image` (a file or a folder) and `--out`."""
    source = Path(image)
    if source.is_dir():
        pictures = sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in PICTURE_SUFFIXES)
        if not pictures:
            raise DataError(f"--image {source}: a folder with no pictures "
                            f"({', '.join(PICTURE_SUFFIXES)})")
        folder = Path(out) if out else source.resolve().with_name(source.resolve().name + "_pose")
        if folder.is_file():
            raise DataError(f"--out {folder}: a file; with a folder as --image, --out is a folder")
        return [(p, folder / f"{p.stem}_pose.png") for p in pictures]
    if not source.exists():
        raise DataError(f"--image {source}: no such file or folder")
    target = Path(out) if out else source.with_name(source.stem + "_pose.png")
    if target.is_dir():
        target = target / f"{source.stem}_pose.png"
    return [(source, check_picture_path(target))]     # refused before the model is loaded


def annotated(picture: np.ndarray, prediction, heatmaps: bool, skeleton) -> np.ndarray:
    """The picture with its people drawn, and the maps panel beside it with `heatmaps`."""
    drawn = draw_people(picture, [person.keypoints for person in prediction.people], skeleton)
    if not heatmaps:
        return drawn
    height, width = prediction.maps.shape[1:]       # smaller than a picture over MAX_SIDE
    panel = maps_panel(cv2.resize(picture, (width, height), interpolation=cv2.INTER_AREA), prediction.maps,
                       skeleton)
    return np.hstack([drawn, cv2.resize(panel, (picture.shape[1], picture.shape[0]))])


def with_predictions(estimator, pictures):
    """(picture, its `Prediction` with maps) of each picture, in order, from the estimator's stream."""
    shown, read = itertools.tee(pictures)
    return zip(shown, estimator.stream(read, maps=True))


def draw_pictures(estimator, pairs, heatmaps: bool, overwrite: bool) -> list[Path]:
    written = []
    pictures = (read_picture(source) for source, _ in pairs)
    for (source, target), (picture, prediction) in zip(pairs, with_predictions(estimator, pictures)):
        drawn = annotated(picture, prediction, heatmaps, estimator.skeleton)
        written.append(write_image(target, drawn, overwrite=overwrite))
        for k, person in enumerate(prediction.people):
            found = int((person.keypoints[:, 2] > 0).sum())
            print(f"person {k}: score {person.score:.3f}, {found} keypoints")
        print(f"{len(prediction.people)} people found in {source}; written to {target}", flush=True)
    return written


def draw_video(estimator, opened, target, heatmaps: bool, overwrite: bool) -> None:
    """Annotate every frame of `opened` into the video `target` (None: a live window); prints frames/s."""
    capture, first = opened
    total = max(int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), 0) if target is not None else 0
    size, fps = (first.shape[1] * (2 if heatmaps else 1), first.shape[0]), frame_rate(capture)
    start, count = time.perf_counter(), 0
    with (video_out(target, fps, size, overwrite) if target is not None else live_window()) as show, \
            tqdm(total=total or None, desc="video", unit="frame", dynamic_ncols=True,
                 disable=target is None) as bar:
        for picture, prediction in with_predictions(estimator, frames(*opened)):
            closed = show(annotated(picture, prediction, heatmaps, estimator.skeleton))   # q or Esc
            count += 1
            bar.update()
            if closed:
                break
    seconds = time.perf_counter() - start
    where = f"; written to {target}" if target is not None else ""
    print(f"{count} frames in {seconds:.1f} s: {count / max(seconds, 1e-9):.2f} frames/s{where}", flush=True)


@contextlib.contextmanager
def live_window():
    """The camera's window: a function showing a frame that says whether q or Esc closed the window."""
    def show(frame: np.ndarray) -> bool:
        try:
            cv2.imshow("demo.py (q or Esc ends)", frame)
        except cv2.error:
            raise DataError("--camera: this OpenCV has no window support (opencv-python-headless); "
                            "install opencv-python to show the live window") from None
        return (cv2.waitKey(1) & 0xFF) in (ord("q"), 27)
    try:
        yield show
    finally:
        cv2.destroyAllWindows()


def run(args) -> list[Path]:
    if args.image is not None:
        pairs = pictures_to_draw(args.image, args.out)
        refuse_clashes({"--weights": args.weights, "--image": [source for source, _ in pairs],
                        "--preset": args.preset}, {"--out": [target for _, target in pairs]})
        for _, target in pairs:
            refuse_existing("--out", target, args.overwrite)
    elif args.video is not None:
        target = check_video_out(args.out or Path(args.video).with_name(Path(args.video).stem + "_pose.mp4"))
        refuse_clashes({"--weights": args.weights, "--video": args.video, "--preset": args.preset},
                       {"--out": target})
        refuse_existing("--out", target, args.overwrite)
        opened = open_video(args.video)
    else:
        refuse_inapplicable({"--out": args.out, "--overwrite": args.overwrite or None}, "to --camera",
                            "its frames are shown in a live window and nothing is written")
        opened, target = open_camera(args.camera), None
    from inference.estimator import PoseEstimator    # torch: once the command line is read
    estimator = PoseEstimator.from_file(args.weights, args.device, preset=args.preset, sets=args.set,
                                        scales=args.scales, flip=args.flip)
    if args.image is not None:
        return draw_pictures(estimator, pairs, args.heatmaps, args.overwrite)
    if target is None:      # live: show each frame as soon as it is done
        estimator.settings.inference.batch_size = estimator.settings.inference.decode_threads = 1
        estimator.window = 1
    draw_video(estimator, opened, target, args.heatmaps, args.overwrite)
    return [target] if target is not None else []


main = command_main(build_parser, run, "the pictures already written are kept; a video being written is "
                    "removed, and an existing --out is as it was")


if __name__ == "__main__":
    sys.exit(main())
