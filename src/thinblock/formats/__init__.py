"""Stream formats, as codecs with no I/O: bytes in, events out, and back."""
