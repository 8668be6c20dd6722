import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
TINY = ["tiny-llava-ov", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]


@pytest.fixture(scope="session")
def backbones():
    from mmkv_cli.backbones import load_backbone
    from mmkv_cli.options import LoadOptions

    return {name: load_backbone(LoadOptions(name, "cpu")) for name in TINY}


@pytest.fixture(scope="session")
def clip() -> str:
    return str(SAMPLES / "clip.mp4")
