"""Everything that crosses GPUs: peer workspaces, the Triton all-reduce kernels, and the Communicator."""
