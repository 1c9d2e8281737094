"""Draws the example images with PIL, so the repo ships no third-party pictures. Run: python assets/make_examples.py"""
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).parent
FONTS = "/usr/share/fonts/truetype/dejavu/"


def font(size: int, bold: bool = False, mono: bool = False) -> ImageFont.FreeTypeFont:
    name = "DejaVuSansMono" if mono else "DejaVuSans-Bold" if bold else "DejaVuSans"
    return ImageFont.truetype(FONTS + name + ".ttf", size)


def chart() -> Image.Image:
    image = Image.new("RGB", (640, 480), "white")
    draw = ImageDraw.Draw(image)
    draw.text((320, 30), "Fruit sold in May (boxes)", fill="black", font=font(26, bold=True), anchor="mm")
    bars = [("Apples", 42, "#d62728"), ("Bananas", 30, "#e6b800"), ("Cherries", 18, "#8c1c3c"),
            ("Pears", 25, "#2ca02c")]
    base, scale = 420, 7
    draw.line((60, base, 600, base), fill="black", width=2)
    for i, (name, value, colour) in enumerate(bars):
        x = 90 + i * 130
        draw.rectangle((x, base - value * scale, x + 80, base), fill=colour)
        draw.text((x + 40, base - value * scale - 18), str(value), fill="black", font=font(20, bold=True), anchor="mm")
        draw.text((x + 40, base + 22), name, fill="black", font=font(20), anchor="mm")
    return image


def receipt() -> Image.Image:
    image = Image.new("RGB", (420, 440), "#f4f1ea")
    draw = ImageDraw.Draw(image)
    draw.text((210, 40), "CORNER CAFE", fill="black", font=font(28, bold=True), anchor="mm")
    draw.text((210, 75), "12 Harbour St.  2024-05-17 09:41", fill="black", font=font(15, mono=True), anchor="mm")
    items = [("Cappuccino", "3.80"), ("Croissant", "2.50"), ("Orange juice", "4.20"), ("Bagel + cream", "5.90")]
    y = 130
    for name, price in items:
        draw.text((40, y), name, fill="black", font=font(20, mono=True))
        draw.text((380, y), price, fill="black", font=font(20, mono=True), anchor="ra")
        y += 40
    draw.line((40, y + 10, 380, y + 10), fill="black", width=2)
    draw.text((40, y + 30), "TOTAL", fill="black", font=font(24, bold=True))
    draw.text((380, y + 30), "16.40", fill="black", font=font(24, bold=True), anchor="ra")
    draw.text((210, y + 100), "Paid by card. Thank you!", fill="black", font=font(16, mono=True), anchor="mm")
    return image


def scene() -> Image.Image:
    image = Image.new("RGB", (640, 480), "#8fd3ff")
    draw = ImageDraw.Draw(image)
    draw.ellipse((500, 40, 590, 130), fill="#ffd23f")
    draw.rectangle((0, 340, 640, 480), fill="#4caf50")
    draw.rectangle((120, 220, 320, 360), fill="#c0392b")
    draw.polygon([(100, 220), (220, 130), (340, 220)], fill="#5d4037")
    draw.rectangle((195, 290, 245, 360), fill="#6d4c41")
    draw.rectangle((140, 245, 180, 280), fill="#e3f2fd")
    draw.rectangle((260, 245, 300, 280), fill="#e3f2fd")
    draw.rectangle((455, 260, 480, 360), fill="#795548")
    draw.ellipse((410, 170, 525, 285), fill="#2e7d32")
    return image


def shapes() -> Image.Image:
    image = Image.new("RGB", (640, 480), "white")
    draw = ImageDraw.Draw(image)
    for x, y in [(90, 100), (300, 80), (500, 150), (200, 330)]:
        draw.ellipse((x - 45, y - 45, x + 45, y + 45), fill="#e53935")
    for x, y in [(420, 340), (110, 250)]:
        draw.rectangle((x - 40, y - 40, x + 40, y + 40), fill="#1e88e5")
    draw.polygon([(560, 300), (610, 400), (510, 400)], fill="#fdd835")
    return image


# The questions asked about them live with the examples in qvl/serve/ui.py.
IMAGES = {"chart.png": chart, "receipt.png": receipt, "scene.png": scene, "shapes.png": shapes}

if __name__ == "__main__":
    for name, draw in IMAGES.items():
        draw().save(HERE / name, optimize=True)
        print(HERE / name)
