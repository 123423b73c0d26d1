import os

# Triton kernels run on CPU tensors through the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# One intra-op thread: tiny models are overhead-bound, torchrun tests start several processes on a
# 2-core machine, and oversubscribed OpenMP threads make everything many times slower.
torch.set_num_threads(int(os.environ.get("MINISPEC_TEST_THREADS", "1")))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """A tiny random Llama checkpoint (vocab 256), shared by the engine-level tests."""
    from tests.utils import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("target")), seed=0)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    """A different tiny random model over the same vocabulary: a poor but valid draft."""
    from tests.utils import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("draft")), seed=1, num_hidden_layers=1)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip cleanly where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
