"""Turning whatever a user uploads into an RGB image the model can afford, or one clear error."""
import builtins
import dataclasses
import functools
import hashlib
import io
import math
import os
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from qvl import documents, texts, video
from qvl.conversation import InputError

PIXELS_PER_TOKEN = 32 * 32  # 16 px patches, merged 2x2 into one visual token
MAX_SOURCE_PIXELS = 64_000_000  # refuse decompression bombs long before they reach memory
MAX_ASPECT = 100  # Qwen's processor refuses 200:1; thinner strips are padded, not refused


class ImageError(InputError):
    """An upload that is not a usable image."""


def load(source) -> Image.Image:
    """Open a path, bytes or PIL image; return it decoded, EXIF-oriented and RGB, or raise ImageError."""
    name = os.path.basename(source) if isinstance(source, (str, os.PathLike)) else "image"
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, bytes):
            source = io.BytesIO(source)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(source)
        except FileNotFoundError:
            raise ImageError("not_found", name=name) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # PIL's own, higher limit
            raise _too_large(name, lambda lang: texts.TEXT[lang]["far_too_many"]) from None
        except (UnidentifiedImageError, OSError) as e:
            empty = "empty" in str(e) or _size(source) == 0
            raise ImageError("empty_file" if empty else "not_image", detail=str(e), name=name) from None
    w, h = image.size
    if w < 1 or h < 1 or w * h > MAX_SOURCE_PIXELS:
        raise _too_large(name, f"{w}x{h}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.seek(0)  # the first frame of an animation
            image = ImageOps.exif_transpose(image)
            image = _to_rgb(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as e:
        raise ImageError("damaged", detail=str(e), name=name) from None
    return image


class Picture:
    """An upload decoded once, as load() decodes it, and a hash of its pixels: what every cache keys the image by (the
    answer cache, conversation memory, the image-feature store), so that none of them decodes or hashes it again."""

    def __init__(self, image: Image.Image):
        self.image = image

    @functools.cached_property
    def digest(self) -> str:
        """Computed on first use, so a request that nothing keys is never hashed."""
        return _digest(self.image)


def _digest(image: Image.Image) -> str:
    """The same pixels hash alike from any file, format or orientation; one changed pixel does not."""
    return hashlib.sha256(f"{image.mode} {image.width}x{image.height}\n".encode() + image.tobytes()).hexdigest()


def open(source) -> Picture:
    """A path, bytes or PIL image decoded into a Picture (raising ImageError as load() does); a Picture or a
    video.Clip as it is."""
    return source if isinstance(source, (Picture, video.Clip)) else Picture(load(source))


def opened(turns: list, params) -> list:
    """turns (conversation.Turn) with each upload decoded once for all that read it after: an image as a Picture, a
    PDF as the Pictures of its pages, in order, a video or an animated GIF as a video.Clip. params (GenParams) holds
    the limits (max_pdf_pages, max_video_frames)."""
    return [dataclasses.replace(turn, images=tuple(item for source in turn.images for item in _uploaded(source, params)))
            for turn in turns]


def _uploaded(source, params) -> list:
    if isinstance(source, (Picture, video.Clip, Image.Image)):
        return [open(source)]
    kind, head = sniff(source)
    name = os.path.basename(source) if isinstance(source, (str, os.PathLike)) else "upload"
    if kind == "pdf":
        return [Picture(load(page)) for page in documents.pages(source, name, params.max_pdf_pages)]
    if kind == "video":
        return [video.load(source, head, name, params.max_video_frames)]
    return [open(source)]


def sniff(source) -> tuple[str, bytes]:
    """What an upload (a path or bytes) is, by its name and first bytes: "pdf", "video" (an animated GIF too) or
    "image" (whatever else, which load() then decodes or refuses); and those bytes. ImageError for a file gone."""
    name = os.path.basename(source) if isinstance(source, (str, os.PathLike)) else "upload"
    try:
        with builtins.open(source, "rb") if isinstance(source, (str, os.PathLike)) else io.BytesIO(source) as file:
            head = file.read(1024)
    except FileNotFoundError:
        raise ImageError("not_found", name=name) from None
    if documents.is_pdf(source, head):
        return "pdf", head
    return ("video" if video.is_video(source, head) else "image"), head


def _too_large(name: str, size) -> ImageError:
    return ImageError("too_many_pixels", name=name, size=size, limit=MAX_SOURCE_PIXELS // 1_000_000)


def _size(source) -> int | None:
    try:
        return os.path.getsize(source) if isinstance(source, (str, os.PathLike)) else len(source.getbuffer())
    except (OSError, AttributeError, ValueError):
        return None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB for every mode PIL decodes: palette+alpha and RGBA composite on white, 16-bit and CMYK convert."""
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greyscale scaled to 8 bits, not clipped; point() only takes the native-endian "I" mode
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGB", image.size, "white")
        background.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        return background
    image = image.convert("RGB")
    image.load()
    return image


def fit(width: int, height: int, max_tokens: int, min_tokens: int) -> tuple[int, int]:
    """The size (w, h), multiples of 32 with the aspect ratio kept, costing min_tokens..max_tokens tokens."""
    w, h = max(32, round(width / 32) * 32), max(32, round(height / 32) * 32)
    if w * h > max_tokens * PIXELS_PER_TOKEN:
        beta = math.sqrt(width * height / (max_tokens * PIXELS_PER_TOKEN))
        w, h = max(32, math.floor(width / beta / 32) * 32), max(32, math.floor(height / beta / 32) * 32)
        while w * h > max_tokens * PIXELS_PER_TOKEN:  # a very thin strip floored to 32 can still be over
            w, h = (w - 32, h) if w >= h else (w, h - 32)
    elif w * h < min_tokens * PIXELS_PER_TOKEN:
        beta = math.sqrt(min_tokens * PIXELS_PER_TOKEN / (width * height))
        w, h = math.ceil(width * beta / 32) * 32, math.ceil(height * beta / 32) * 32
    return w, h


def tokens(image: Image.Image) -> int:
    return image.width * image.height // PIXELS_PER_TOKEN


def prepare(image: Image.Image, max_tokens: int, min_tokens: int) -> Image.Image:
    """Resize to the token budget; this is the biggest speed lever there is on a CPU."""
    w, h = image.size
    if max(w, h) > MAX_ASPECT * min(w, h):
        padded = Image.new("RGB", (max(w, h // MAX_ASPECT), max(h, w // MAX_ASPECT)), "white")
        padded.paste(image, ((padded.width - w) // 2, (padded.height - h) // 2))
        image = padded
    size = fit(image.width, image.height, max_tokens, min_tokens)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)
