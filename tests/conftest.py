import os

# Triton kernels run on CPU tensors through the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# One intra-op thread: tiny models are overhead-bound, torchrun tests start several processes on a
# 2-core machine, and oversubscribed OpenMP threads make everything many times slower.
torch.set_num_threads(int(os.environ.get("MINISPEC_TEST_THREADS", "1")))
