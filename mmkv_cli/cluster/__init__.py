"""Work spread over Ray actors (the mmkv[ray] extra): the pool `batch` and `eval` share."""
