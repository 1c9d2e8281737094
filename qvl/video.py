"""A video upload as the frames Qwen3-VL is shown, sampled as its video processor samples them (2 a second, evenly
spread, at most a budget), decoded with PyAV (an animated GIF with PIL); or one clear error."""
import functools
import hashlib
import io
import os

import av
import numpy as np
from PIL import Image, ImageSequence

from qvl.conversation import InputError

FPS = 2  # what Qwen3-VL's video processor samples
MAX_SECONDS = 120  # a longer clip takes longer to decode on 2 cores than its few sampled frames are worth
MAX_FRAME_PIXELS = 3840 * 2160  # 4K: a larger frame costs decoding time that no image budget needs
SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi")


class Clip:
    """A video sampled once: its frames (RGB, one size), each one's index in the source and the source's frame rate
    (a frame's time is index / fps, as transformers counts it), and a digest of the frames and their times, which
    every cache keys the video by."""

    def __init__(self, frames: list[Image.Image], indices: list[int], fps: float):
        self.frames, self.indices, self.fps = frames, indices, fps

    @functools.cached_property
    def digest(self) -> str:
        h = hashlib.sha256(f"video {self.fps} {self.indices} {self.frames[0].size}\n".encode())
        for frame in self.frames:
            h.update(frame.tobytes())
        return h.hexdigest()


def is_video(source, head: bytes) -> bool:
    """A file named as a video, or content that begins as MP4/MOV, WebM/Matroska or an animated GIF does."""
    named = isinstance(source, (str, os.PathLike)) and os.fspath(source).lower().endswith(SUFFIXES)
    if head[:4] == b"GIF8":
        try:
            with Image.open(_file(source)) as image:
                return getattr(image, "n_frames", 1) > 1
        except (OSError, SyntaxError, ValueError):
            return False  # the image decoder says what is wrong with it
    return named or head[4:8] == b"ftyp" or head[:4] == b"\x1a\x45\xdf\xa3"


def sample(total: int, fps: float, max_frames: int) -> list[int]:
    """The indices of the frames to keep: FPS a second, at least 2 (one frame pair), at most max_frames, evenly
    spread and rounded as transformers' sample_frames does."""
    n = min(max(int(total / fps * FPS), 2), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def load(source, head: bytes, name: str, max_frames: int) -> Clip:
    """The clip at source (a path or bytes, which begin with head) sampled into a Clip; InputError if it is broken,
    has no picture, is over MAX_SECONDS or its frames are over MAX_FRAME_PIXELS."""
    if head[:4] == b"GIF8":
        with Image.open(_file(source)) as image:
            return _gif(image, name, max_frames)
    try:
        with av.open(_file(source)) as container:
            if not container.streams.video:
                raise InputError("video_audio_only" if container.streams.audio else "video_damaged", name=name)
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > MAX_FRAME_PIXELS:
                raise InputError("too_many_pixels", name=name, size=f"{width}x{height}",
                                 limit=MAX_FRAME_PIXELS // 10**6)
            seconds = container.duration / av.time_base if container.duration else None
            if fps <= 0:
                raise InputError("video_damaged", detail="no frame rate", name=name)
            if seconds is not None and seconds > MAX_SECONDS + 1:  # refused before a packet is read
                raise _too_long(name, seconds)
            # The container's frame count can be missing (WebM) or wrong: its packets are counted, which reads no
            # pixels.
            total = sum(1 for packet in container.demux(stream) if packet.size)
            if total / fps > MAX_SECONDS + 1:
                raise _too_long(name, total / fps)
            if total == 0:
                raise InputError("video_damaged", detail="no frames", name=name)
            wanted = sample(total, fps, max_frames)
            container.seek(0)
            stream.thread_type = "AUTO"
            frames = {}
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    frames[i] = frame.to_image().convert("RGB")
                if i >= wanted[-1]:
                    break
    except av.FFmpegError as e:
        raise InputError("video_damaged", detail=str(e), name=name) from None
    got = [i for i in wanted if i in frames]
    if not got:
        raise InputError("video_damaged", detail="nothing decoded", name=name)
    size = frames[got[0]].size  # a stream that changes size mid-way is shown at its first frame's
    return Clip([frames[i] if frames[i].size == size else frames[i].resize(size) for i in got], got, fps)


def _gif(image: Image.Image, name: str, max_frames: int) -> Clip:
    """An animated GIF as a clip at its average frame rate (GIF frames each carry their own delay)."""
    if image.width * image.height > MAX_FRAME_PIXELS:
        raise InputError("too_many_pixels", name=name, size=f"{image.width}x{image.height}",
                         limit=MAX_FRAME_PIXELS // 10**6)
    total = image.n_frames
    seconds = sum(frame.info.get("duration", 100) or 100 for frame in ImageSequence.Iterator(image)) / 1000
    if seconds > MAX_SECONDS + 1:
        raise _too_long(name, seconds)
    fps = total / seconds
    wanted = sample(total, fps, max_frames)
    frames = []
    for i in wanted:
        image.seek(i)
        frames.append(image.convert("RGB"))
    return Clip(frames, wanted, fps)


def _too_long(name: str, seconds: float) -> InputError:
    return InputError("video_too_long", name=name, seconds=round(seconds), limit=MAX_SECONDS)


def _file(source):
    return io.BytesIO(source) if isinstance(source, bytes) else source
