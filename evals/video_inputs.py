"""Clips and greedy answers for the video benchmarks (V-STaR, DOVE: ``python -m cli.evaluate vstar | dove``).

- `VideoIndex` finds a benchmark's video by id under a folder (``<vid>.mp4`` as the releases ship them, or the toy
  video world's ``<vid>.npz`` of ``frames`` ``[T, H, W, 3]`` uint8), searched once, recursively, as V-STaR's
  ``inference_demo.py`` looks for ``<vid>.mp4`` in any subfolder;
- `load_clip` reads it as a `VideoClip` sampled at ``fps`` (V-STaR's inference samples 1 fps), at most
  ``max_frames`` frames (evenly spaced over the clip when there are more), each frame scaled down to at most
  ``max_pixels`` pixels (the processor keeps a clip's native size, so a 1280 x 720 video would otherwise cost
  ~1,200 visual tokens a temporal patch); an odd frame count drops the last frame (Qwen-VL's temporal patches hold 2);
- `video_prompt` renders one free-form question about a clip in the processor's chat template, as
  ``build_prompt_text(..., video=True)`` renders a named template's question (the benchmarks ask their own questions,
  which are not prompt templates of the training methods);
- `greedy_video_answers` generates one greedy answer per (question, clip) through the project's rollout engine and
  returns the texts with the frame size each clip had at the model's input (the frame answers' boxes are written in).

Mp4 decoding uses OpenCV (``cv2``), which the environment has; the toy fixtures use npz files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from core.records import DataError
from core.video import VideoClip
from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine

__all__ = ["VIDEO_SUFFIXES", "VideoIndex", "answer_part", "greedy_video_answers", "load_clip", "video_prompt"]

VIDEO_SUFFIXES = (".mp4", ".npz", ".webm", ".mkv", ".avi", ".mov")


class VideoIndex:
    """The videos under ``root`` by file stem (searched once, recursively); ``path(vid)`` or a `DataError`."""

    def __init__(self, root: str | Path, flag: str = "--video-root"):
        self.root, self.flag = Path(root), flag
        if not self.root.is_dir():
            raise FileNotFoundError(f"{flag} {self.root}: no such folder (the benchmark's videos)")
        self._by_stem: dict[str, Path] = {}
        for p in sorted(self.root.rglob("*")):
            if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file():
                self._by_stem.setdefault(p.stem, p)

    def path(self, vid: str, where: str) -> Path:
        if vid in self._by_stem:
            return self._by_stem[vid]
        raise DataError(f"{where}: video {vid!r} not found under {self.flag} {self.root} (looked for {vid}.mp4/.npz)")


def _read_frames(path: Path) -> tuple[list[np.ndarray], float]:
    """All frames of ``path`` (RGB uint8 arrays) and its frame rate (npz: its ``fps`` entry, else 0 = unknown)."""
    if path.suffix.lower() == ".npz":
        with np.load(path) as data:
            frames = [np.asarray(f, dtype=np.uint8) for f in data["frames"]]
            fps = float(data["fps"]) if "fps" in data.files else 0.0
        return frames, fps
    import cv2

    cap = cv2.VideoCapture(str(path))
    if not cap.isOpened():
        raise DataError(f"{path}: OpenCV cannot open this video")
    fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
    frames = []
    try:
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        cap.release()
    return frames, fps


def load_clip(
    path: str | Path, fps: float, native_fps: float | None = None, max_frames: int = 64, max_pixels: int = 448 * 448
) -> VideoClip:
    """The video at ``path`` as a `VideoClip` of frames sampled every ``1 / fps`` seconds (module docstring).
    ``native_fps``: the video's frame rate when the annotation knows it better than the file (V-STaR's ``fps``);
    a toy npz without an ``fps`` entry is taken as already sampled at ``fps``."""
    path = Path(path)
    frames, file_fps = _read_frames(path)
    if len(frames) < 2:
        raise DataError(f"{path}: {len(frames)} frame(s); a clip needs at least 2")
    src_fps = native_fps or file_fps or fps
    duration = len(frames) / src_fps
    step = 1.0 / fps
    n = max(2, min(int(math.floor(duration * fps + 1e-6)), len(frames)))
    if n > max_frames:  # evenly spaced over the clip instead; the clip's rate is then the spacing's
        n, step = max_frames, duration / max_frames
    n -= n % 2
    picked = [frames[min(int(round(i * step * src_fps)), len(frames) - 1)] for i in range(n)]
    images = []
    for f in picked:
        img = Image.fromarray(f).convert("RGB")
        w, h = img.size
        if w * h > max_pixels:
            s = math.sqrt(max_pixels / (w * h))
            img = img.resize((max(28, int(w * s)), max(28, int(h * s))), Image.BILINEAR)
        images.append(img)
    return VideoClip(images, 1.0 / step)


def video_prompt(processor, question: str) -> str:
    """One user turn (the clip, then ``question``) with the generation prompt, in the processor's chat template; a
    template without video items (the toy checkpoint's) renders the image placeholder, swapped for the video one
    (``lightning_modules.models.prompts.build_prompt_text``'s rule)."""

    def render(kind: str) -> str:
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    text = render("video")
    if "<|video_pad|>" in text:
        return text
    text = render("image")
    if text.count("<|image_pad|>") != 1:
        raise ValueError("the processor's chat template renders neither a video item nor one <|image_pad|>")
    return text.replace("<|image_pad|>", "<|video_pad|>")


def greedy_video_answers(
    model, processor, questions: Sequence[str], clips: Sequence[VideoClip], max_new_tokens: int, engine: str = "hf"
) -> tuple[list[str], list[tuple[int, int]]]:
    """One greedy answer per (question, clip) in one generate call: the texts and each clip's model-input frame
    size (width, height) (the frame the answer's boxes are in; the 0-1000 grid for Qwen3-VL)."""
    if len(questions) != len(clips):
        raise ValueError(f"greedy_video_answers: {len(questions)} questions for {len(clips)} clips")
    if not questions:
        return [], []
    requests = [RolloutRequest(video_prompt(processor, q), c, 1, i) for i, (q, c) in enumerate(zip(questions, clips))]
    ro = build_rollout_engine(engine).generate(
        model, processor, requests, Sampling(max_new_tokens=max_new_tokens, greedy=True)
    )
    return list(ro.texts), [tuple(wh) for wh in ro.input_wh]


def answer_part(text: str) -> str:
    """The text inside the last ``<answer> </answer>`` tags when there are any, else the whole text, stripped."""
    start, end = text.rfind("<answer>"), text.rfind("</answer>")
    if start != -1 and end > start:
        return text[start + len("<answer>") : end].strip()
    if start != -1:
        return text[start + len("<answer>") :].strip()
    return text.strip()
