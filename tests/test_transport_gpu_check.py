import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_finds_a_nixl_module():
    api, name = load().load_nixl()
    assert name.endswith("._api") and hasattr(api, "nixl_agent_config")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-CUDA path")
def test_gpu_check_exits_clearly_without_cuda(capsys):
    assert load().main([]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
