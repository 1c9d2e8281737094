"""Video uploads: sampled at 2 frames a second up to --max-video-frames, given to the model as Qwen3-VL video input
with each frame pair's timestamp, keyed by the sampled frames; a clear refusal, and nothing cached, for a broken,
over-long or audio-only file."""
import asyncio
import importlib.util
from dataclasses import replace

import av
import numpy as np
import pytest
import torch
from PIL import Image

from qvl import images, settings, video
from qvl.conversation import InputError, Stats, Turn
from qvl.serve import answers, cache

PARAMS = settings.GenParams(greedy=True, max_new_tokens=6, min_new_tokens=6)


def clip(path, seconds=3, fps=10, size=(96, 64), colour=0):
    """A clip whose picture turns from red through green to blue (channel `colour` first) while a white square
    crosses its top quarter, as an MP4 (MPEG-4 Part 2) or, named .webm, a WebM (VP8, which a browser plays)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libvpx" if str(path).endswith(".webm") else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        side, count = size[1] // 4, seconds * fps
        for i in range(count):
            frame = np.zeros((size[1], size[0], 3), np.uint8)
            frame[..., (colour + i * 3 // count) % 3] = 200
            left = i * (size[0] - side) // max(1, count - 1)
            frame[:side, left:left + side] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def sound(path, seconds=1):
    """An audio-only file: a second of silence as MP4 audio."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        for i in range(seconds * 16000 // 1024):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def opened(source, params=PARAMS) -> video.Clip:
    item, = images.opened([Turn("user", "What happens?", (source,))], params)[0].images
    return item


def test_a_clip_is_sampled_at_two_frames_a_second_within_the_frame_budget(tmp_path):
    path = clip(tmp_path / "c.mp4", seconds=3, fps=10)
    three = opened(path)
    assert isinstance(three, video.Clip) and three.fps == 10 and three.indices == [0, 6, 12, 17, 23, 29]
    assert [f.getpixel((48, 32)).index(max(f.getpixel((48, 32)))) for f in three.frames] == [0, 0, 1, 1, 2, 2]
    four = opened(path, replace(PARAMS, max_video_frames=4))
    assert four.indices == [0, 10, 19, 29] and four.digest != three.digest


def test_a_clip_is_answered_as_video_tokens_after_each_frame_pairs_timestamp(tmp_path, engine):
    turns = images.opened([Turn("user", "What happens?", (clip(tmp_path / "c.mp4"),))], PARAMS)
    inputs, visual = engine._inputs(turns, PARAMS)
    # 96x64 frames are scaled up to the smallest image budget, 16 tokens: 160x128, 20 tokens a frame pair.
    assert inputs["video_grid_thw"].tolist() == [[3, 8, 10]] and "pixel_values" not in inputs
    ids, config = inputs["input_ids"][0], engine.model.config
    assert int((ids == config.video_token_id).sum()) == visual == 3 * 20 and not (ids == config.image_token_id).any()
    assert (inputs["mm_token_type_ids"][0] == 2).sum() == visual
    prompt = engine.processor.tokenizer.decode(ids)
    pads = "<|video_pad|>" * 20
    # Each pair's time is the mean of its frames' (0 and 0.6 s, 1.2 and 1.7 s, 2.3 and 2.9 s), as transformers writes.
    assert (f"<0.3 seconds><|vision_start|>{pads}<|vision_end|><1.4 seconds><|vision_start|>{pads}<|vision_end|>"
            f"<2.6 seconds><|vision_start|>{pads}<|vision_end|>What happens?") in prompt
    *pieces, stats = engine.chat(turns, PARAMS)
    assert isinstance(stats, Stats) and stats.new_tokens == 6 and stats.video_frames == 6 and stats.video_tokens == 60
    assert "video: 6 frames, 60 tokens" in answers.figures("en", answers.Update(stats=stats.__dict__))


def test_conversation_memory_and_the_feature_store_give_the_answer_transformers_computes_in_full(tmp_path, engine,
                                                                                                  cold):
    first = [Turn("user", "What happens?", (clip(tmp_path / "c.mp4"),))]
    follow = [*first, Turn("assistant", "Colours."), Turn("user", "Which comes last?")]
    # The third shares no prefix with the first (its system turn comes first): its features come from the store.
    for turns in (first, follow, [Turn("system", "Be brief."), *first]):
        *warm, stats = engine.chat(turns, PARAMS)
        *full, _ = cold.chat(turns, PARAMS)  # nothing kept: the processor's pixels through transformers' forward
        assert "".join(warm) == "".join(full)
    assert stats.cached_images == 3  # the third question's frame pairs came from the feature store


def test_a_video_is_keyed_by_its_sampled_frames(tmp_path):
    store = cache.AnswerCache(str(tmp_path / "answers"), "10mb")
    keys = [store.key(images.opened([Turn("user", "What?", (path,))], PARAMS), PARAMS, "m") for path in (
        clip(tmp_path / "a.mp4"), clip(tmp_path / "same.mp4"), clip(tmp_path / "b.mp4", colour=1))]
    assert keys[0] == keys[1] != keys[2]


def test_an_animated_gif_is_a_video_and_a_still_one_an_image(tmp_path):
    frames = [Image.new("RGB", (64, 64), c) for c in ("red", "green", "blue", "white")]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:], duration=500)
    frames[0].save(tmp_path / "still.gif")
    animated = opened(str(tmp_path / "a.gif"))
    assert isinstance(animated, video.Clip) and animated.indices == [0, 1, 2, 3] and animated.fps == 2
    assert isinstance(opened(str(tmp_path / "still.gif")), images.Picture)


def refused(source, params=PARAMS) -> InputError:
    with pytest.raises(InputError) as error:
        opened(source, params)
    return error.value


def test_broken_over_long_and_audio_only_files_are_refused_in_both_languages(tmp_path, monkeypatch):
    (tmp_path / "broken.mp4").write_bytes(open(clip(tmp_path / "whole.mp4"), "rb").read()[:300])
    (tmp_path / "notes.webm").write_bytes(b"not a video at all")
    for path, key in ((tmp_path / "broken.mp4", "video_damaged"), (tmp_path / "notes.webm", "video_damaged"),
                      (sound(tmp_path / "voice.m4a"), "video_audio_only")):
        error = refused(str(path))
        name = str(path).rsplit("/")[-1]
        assert error.key == key and name in error.say("en") and name in error.say("zh-CN") != error.say("en")
    monkeypatch.setattr(video, "MAX_SECONDS", 2)
    error = refused(clip(tmp_path / "long.mp4", seconds=5))
    assert error.key == "video_too_long" and "5 s" in error.say("en") and "2 s" in error.say("en")
    assert "5 秒" in error.say("zh-CN")


def test_a_refused_video_is_not_cached_and_the_refusal_reaches_the_user(tmp_path, engine):
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 truncated")
    store = cache.AnswerCache(str(tmp_path / "answers"), "10mb")
    answerer = answers.Answerer(engine, store, settings.parse(["--cache-dir", str(tmp_path)], env={}))

    async def ask():
        return [u async for u in answerer.answer([Turn("user", "What?", (str(tmp_path / "broken.mp4"),))], PARAMS,
                                                 use_cache=True, fresh=False)]

    with pytest.raises(InputError) as error:
        asyncio.run(ask())
    assert error.value.key == "video_damaged" and "broken.mp4" in answers.problem("en", error.value)
    assert store.info()["entries"] == 0


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="transformers' video processor needs torchvision, which qvl does not install")
def test_the_pixel_rows_and_grid_are_what_transformers_video_processor_makes(tmp_path, engine):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    item = opened(clip(tmp_path / "c.mp4"))
    inputs, _ = engine._inputs([Turn("user", "What?", (item,))], PARAMS)
    frames = np.stack([np.asarray(f) for f in item.frames])
    theirs = Qwen3VLVideoProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3)(
        videos=[frames], do_sample_frames=False, do_resize=False, return_tensors="pt",
        video_metadata=[VideoMetadata(total_num_frames=30, fps=item.fps, frames_indices=item.indices)])
    assert torch.equal(inputs["video_grid_thw"], theirs["video_grid_thw"])
    torch.testing.assert_close(inputs["pixel_values_videos"].float(), theirs["pixel_values_videos"].float())
