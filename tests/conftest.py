import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# no config file of the machine's (~/.config/mmkv/config.toml) changes what a test sees
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="mmkv-test-config-")
atexit.register(shutil.rmtree, os.environ["XDG_CONFIG_HOME"], True)  # one left a run otherwise
os.environ.pop("MMKV_CONFIG", None)
# no warm server of the machine's answers a test's commands: a private, empty runtime folder
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="mmkv-rt-")
atexit.register(shutil.rmtree, os.environ["XDG_RUNTIME_DIR"], True)
for _name in ("MMKV_HOST", "MMKV_KEEP_ALIVE", "MMKV_NO_SERVER"):
    os.environ.pop(_name, None)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"


def _tiny_presets() -> list[str]:
    """Every model preset built small and random in code: one per family (test_specs checks)."""
    from mmkv_cli.backbones.spec import load_model_spec, model_names

    return [name for name in model_names() if load_model_spec(name).source == "tiny"]


TINY = _tiny_presets()


@pytest.fixture(scope="session")
def backbones():
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    return {name: load_backbone(LoadOptions(name, "cpu")) for name in TINY}


@pytest.fixture(scope="session")
def clip() -> str:
    return str(SAMPLES / "clip.mp4")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto's server mode) on a free loopback port, with the environment s3fs reads
    pointed at it; a bucket `packs` exists. Yields the endpoint URL."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("packs")
    yield endpoint
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
