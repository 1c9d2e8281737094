"""A PDF upload as the images of its pages, rendered with PDFium (pypdfium2), or one clear error."""
import math
import os
import threading

import pypdfium2 as pdfium
from PIL import Image

from qvl.conversation import InputError

DPI = 200  # small print stays legible, and the image budget scales the page down from there
MAX_PAGE_PIXELS = 16_000_000  # a poster-sized page renders no larger than the largest image budget (16384 tokens)
_PDFIUM = threading.Lock()  # PDFium is not thread-safe, and requests are decoded in threads


def is_pdf(source, head: bytes) -> bool:
    """A file named .pdf (garbage in one gets the PDF's message), or any upload that begins as a PDF does."""
    named = isinstance(source, (str, os.PathLike)) and os.fspath(source).lower().endswith(".pdf")
    return named or head.lstrip()[:5] == b"%PDF-"


def pages(source, name: str, max_pages: int) -> list[Image.Image]:
    """Each page of the PDF at source (a path or bytes) as an RGB image, in order; InputError if it is broken,
    locked, empty or longer than max_pages."""
    with _PDFIUM:
        try:
            document = pdfium.PdfDocument(source)
        except pdfium.PdfiumError as e:
            raise InputError("pdf_locked" if "password" in str(e).lower() else "pdf_damaged", detail=str(e),
                             name=name) from None
        try:
            if len(document) == 0:
                raise InputError("pdf_damaged", detail="no pages", name=name)
            if len(document) > max_pages:
                raise InputError("pdf_too_many_pages", name=name, pages=len(document), limit=max_pages)
            out = []
            for page in document:
                width, height = page.get_size()  # in points, 72 to the inch
                scale = min(DPI / 72, math.sqrt(MAX_PAGE_PIXELS / max(1.0, width * height)))
                try:
                    out.append(page.render(scale=scale).to_pil().convert("RGB"))
                except pdfium.PdfiumError as e:
                    raise InputError("pdf_damaged", detail=str(e), name=name) from None
            return out
        finally:
            document.close()
