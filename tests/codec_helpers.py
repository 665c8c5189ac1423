"""What the codec's tests share (test_codec.py, test_codec_reader.py): hypothesis's settings and the codecs'
bit widths."""

from hypothesis import settings

FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None)
ALL_BITS = [8, 4, "e3m0", 32]
