"""The moving half: disk I/O pool (and, with a GPU, CUDA streams). Never decides policy."""
