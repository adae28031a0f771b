import os

import torch

# Triton kernels run under the interpreter when there is no GPU. It must be set before any
# @triton.jit function is defined, so it lives here, ahead of every test import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
