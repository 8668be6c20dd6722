"""mmkv: encode media into a compressed KV cache once, answer questions from it later."""

__version__ = "0.1.0"
