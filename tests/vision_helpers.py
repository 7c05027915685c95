"""Images for the vision-language tests (tests/test_vision.py, tests/engines/test_vision_engine.py):
one solid colour each, so a test knows what only the image tells."""

import io

COLOURS = {"red": (230, 20, 20), "blue": (20, 20, 230)}


def png(colour: str, size: tuple[int, int] = (16, 16)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(buf, format="PNG")
    return buf.getvalue()
